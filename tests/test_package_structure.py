"""The package's shape, read from its source alone (ast; nothing is imported): its folders are
its layers, no module imports one from a higher layer, no import cycle, no module over 400
lines, no function over 80, and only the entry points at the root.

A module's layer is the folder of `rayexport/` it sits in (the root's modules are the entry
points, the top); LAYERS orders the folders, and every folder on disk must be in it, so a new
folder forces a decision about where it belongs."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]
PACKAGE = "rayexport"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80
MAX_ROOT_MODULES = 8
ROOT = ""

# The layers, lowest first, each a folder of the package (ROOT: its own modules). A module may
# import modules of its own layer and of lower ones, never of a higher one.
LAYERS: tuple[tuple[str, str], ...] = (
    ("common", "what every layer uses: the error type, dtype names, verification levels, memory, bounded scans"),
    ("storage", "fsspec URIs, commit-or-discard writes, retrying reads, S3, node-local disks"),
    ("plan", "pure planning over what readers report: pieces, names, ties, LoRA, formats, files, buckets"),
    ("model", "the Hugging Face model: its folder, config and meta-device model, its on-disk format, remote code"),
    ("layouts", "the readers: what a checkpoint holds and how a worker reads its part"),
    ("transport", "assembly, the gather, the safetensors writer and the manifest"),
    ("verification", "the checks before the commit, and the consumer checks"),
    ("orchestration", "options, Ray: placement, workers, the group, pools, the export's steps and report"),
    (ROOT, "the entry points: python -m rayexport.run / .verify, export_remote, the watcher, the demo"),
)


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    is_package: bool
    source: str

    def where(self, line: int) -> str:
        """`path:line`, relative to the repository when inside it, for messages."""
        path = self.path.relative_to(REPOSITORY) if self.path.is_relative_to(REPOSITORY) else self.path
        return f"{path}:{line}"


@dataclass(frozen=True)
class Import:
    module: Module
    line: int
    target: str  # the package module it loads
    written: str  # the statement, as in the source


def find_modules(root: Path, package: str) -> list[Module]:
    """Every source file of the package rooted at the folder `root`, as a module."""
    modules = []
    for path in sorted(root.rglob("*.py")):
        parts = (package, *path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        modules.append(Module(name, path, is_package, path.read_text()))
    return modules


def importable(modules: list[Module]) -> dict[str, Module]:
    """The module Python imports for each name: a package's `__init__.py` over a `.py` file of
    the same name beside it."""
    chosen: dict[str, Module] = {}
    for module in modules:
        if module.name not in chosen or module.is_package:
            chosen[module.name] = module
    return chosen


def shadowed_modules(modules: list[Module]) -> list[str]:
    """Each file that Python never imports, since a package of the same name stands beside it."""
    chosen = importable(modules)
    return [
        f"{module.where(1)} {module.name}: shadowed by {chosen[module.name].where(1)}"
        for module in modules if chosen[module.name] is not module
    ]


def imports_of(module: Module, known: set[str], package: str) -> list[Import]:
    """Every import of a package module anywhere in `module` (function bodies and
    `if TYPE_CHECKING:` included), resolved to the module it loads."""
    found = []
    for node in ast.walk(ast.parse(module.source, filename=str(module.path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node)
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        written = ast.get_source_segment(module.source, node) or ast.unparse(node)
        for name in dict.fromkeys(names):
            if name == package or name.startswith(package + "."):
                target = _longest_known_prefix(name, known)
                if target not in (None, module.name):
                    found.append(Import(module, node.lineno, target, " ".join(written.split())))
    return found


def _absolute(module: Module, node: ast.ImportFrom) -> str:
    """The module a `from ... import` names, with a relative one made absolute."""
    if not node.level:
        return node.module or ""
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
    return f"{base}.{node.module}" if node.module else base


def _longest_known_prefix(name: str, known: set[str]) -> str | None:
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in known:
            return ".".join(parts[:end])
    return None


def layer_of(module: "Module", root: Path) -> str:
    """The layer of `module`: the folder of the package root `root` that holds it, or ROOT."""
    parts = module.path.relative_to(root).parts
    return parts[0] if len(parts) > 1 else ROOT


def layer_index(layers=LAYERS) -> dict[str, int]:
    return {name: index for index, (name, _) in enumerate(layers)}


def unlisted_folders(root: Path, layers=LAYERS) -> list[str]:
    """The package's folders that LAYERS does not order, and the layers with no folder on disk."""
    on_disk = {path.name for path in root.iterdir() if path.is_dir() and (path / "__init__.py").exists()}
    listed = {name for name, _ in layers if name != ROOT}
    return [f"{root / name}: a folder with no place in LAYERS" for name in sorted(on_disk - listed)] + [
        f"{name}: in LAYERS but not a folder of {root}" for name in sorted(listed - on_disk)
    ]


def root_modules(modules: list["Module"], root: Path) -> list["Module"]:
    return [module for module in modules if layer_of(module, root) == ROOT]


def import_cycles(imports: list[Import]) -> list[str]:
    """Each group of modules that import one another in a circle (a strongly connected
    component of the import graph), with every import that binds it."""
    graph: dict[str, set[str]] = {}
    for edge in imports:
        graph.setdefault(edge.module.name, set()).add(edge.target)
    problems = []
    for component in _strongly_connected(graph):
        if len(component) > 1:
            inside = [edge for edge in imports if edge.module.name in component and edge.target in component]
            lines = [f"  {edge.module.where(edge.line)} {edge.module.name} -> {edge.target}: {edge.written}" for edge in inside]
            problems.append(f"cycle among {', '.join(sorted(component))}:\n" + "\n".join(lines))
    return sorted(problems)


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph.get(successor, ())))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    components.append(component)
    return components


def upward_imports(imports: list[Import], modules: dict[str, "Module"], root: Path, layers=LAYERS) -> list[str]:
    """Each import of a module from a higher layer than the importer's."""
    order = layer_index(layers)
    problems = []
    for edge in imports:
        own, target = layer_of(edge.module, root), layer_of(modules[edge.target], root)
        if order[target] > order[own]:
            problems.append(
                f"{edge.module.where(edge.line)} {edge.module.name} ({own or 'root'}) imports "
                f"{edge.target} ({target or 'root'}): {edge.written}"
            )
    return problems


def long_modules(modules: list[Module], limit: int = MAX_MODULE_LINES) -> list[str]:
    """Each module longer than `limit` lines."""
    counts = [(module, len(module.source.splitlines())) for module in modules]
    return [f"{module.where(1)} {module.name}: {count} lines" for module, count in counts if count > limit]


def long_functions(modules: list[Module], limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Each function or method longer than `limit` lines, from its `def` line (decorators not
    counted) to its last line."""
    problems = []

    def visit(module: Module, node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{scope}{child.name}"
                length = child.end_lineno - child.lineno + 1
                if not isinstance(child, ast.ClassDef) and length > limit:
                    problems.append(f"{module.where(child.lineno)} {module.name}.{name}: {length} lines")
                visit(module, child, name + ".")
            else:
                visit(module, child, scope)

    for module in modules:
        visit(module, ast.parse(module.source, filename=str(module.path)), "")
    return problems


def all_imports(modules: dict[str, Module], package: str) -> list[Import]:
    """Every import of a package module in the package's `importable` modules."""
    return [edge for module in modules.values() for edge in imports_of(module, set(modules), package)]


def _fail_listing(problems: list[str], what: str) -> None:
    if problems:
        pytest.fail(f"{len(problems)} {what}:\n" + "\n".join(problems), pytrace=False)


@pytest.fixture(scope="module")
def modules() -> list[Module]:
    return find_modules(REPOSITORY / PACKAGE, PACKAGE)


def test_every_folder_is_a_layer():
    _fail_listing(unlisted_folders(REPOSITORY / PACKAGE), "folder(s) and layer(s) that do not match")


def test_the_root_holds_only_a_few_modules(modules):
    names = [module.name for module in root_modules(modules, REPOSITORY / PACKAGE)]
    assert len(names) <= MAX_ROOT_MODULES, f"{len(names)} modules at the package's root: {', '.join(names)}"


def test_no_module_is_shadowed_by_a_package(modules):
    _fail_listing(shadowed_modules(modules), "file(s) Python never imports")


def test_the_import_graph_has_no_cycle(modules):
    _fail_listing(import_cycles(all_imports(importable(modules), PACKAGE)), "import cycle(s)")


def test_no_module_imports_a_higher_layer(modules):
    layers = " -> ".join(name or "root" for name, _ in LAYERS)
    chosen = importable(modules)
    _fail_listing(
        upward_imports(all_imports(chosen, PACKAGE), chosen, REPOSITORY / PACKAGE),
        f"upward import(s), layers lowest first: {layers}",
    )


def test_no_module_is_over_the_limit(modules):
    _fail_listing(long_modules(modules), f"module(s) over {MAX_MODULE_LINES} lines")


def test_no_function_is_over_the_limit(modules):
    _fail_listing(long_functions(modules), f"function(s) over {MAX_FUNCTION_LINES} lines")


def test_the_checks_find_what_they_guard_against(tmp_path):
    """The checks on a small package of known faults: a relative import and one inside a
    function both count, a cycle is named with its imports, a module beside a package of its
    name is found, a folder LAYERS lacks is named, a decorator is not counted."""
    root = tmp_path / "pkg"
    for folder in ("low", "high", "stray"):
        (root / folder).mkdir(parents=True)
    sources = {
        "__init__.py": "",
        "top.py": "from pkg.high import h\n",
        "low/__init__.py": "from . import leaf\n",
        "low/leaf.py": "def f():\n    from pkg.high import h\n" + "@staticmethod\n" * 5 + "def g():\n" + "    pass\n" * 3,
        "high/__init__.py": "",
        "high/h.py": "from ..low.leaf import f\n" + "x = 1\n" * 12,
        "stray/__init__.py": "",
        "low.py": "",
    }
    for name, text in sources.items():
        (root / name).write_text(text)
    layers = (("low", ""), ("high", ""), (ROOT, ""))
    files = find_modules(root, "pkg")
    modules = importable(files)
    imports = all_imports(modules, "pkg")

    assert {(edge.module.name, edge.line, edge.target) for edge in imports} == {
        ("pkg.top", 1, "pkg.high.h"), ("pkg.low", 1, "pkg.low.leaf"), ("pkg.low.leaf", 2, "pkg.high.h"),
        ("pkg.high.h", 1, "pkg.low.leaf"),
    }
    assert unlisted_folders(root, layers) == [f"{root / 'stray'}: a folder with no place in LAYERS"]
    assert [module.name for module in root_modules(files, root)] == ["pkg", "pkg.low", "pkg.top"]
    [cycle] = import_cycles(imports)
    assert cycle.startswith("cycle among pkg.high.h, pkg.low.leaf:") and "leaf.py:2 pkg.low.leaf -> pkg.high.h: from pkg.high import h" in cycle
    assert upward_imports(imports, modules, root, layers) == [
        f"{root / 'low/leaf.py'}:2 pkg.low.leaf (low) imports pkg.high.h (high): from pkg.high import h"
    ]
    assert shadowed_modules(files) == [f"{root / 'low.py'}:1 pkg.low: shadowed by {root / 'low/__init__.py'}:1"]
    assert long_modules(files, limit=11) == [f"{root / 'high/h.py'}:1 pkg.high.h: 13 lines"]
    assert long_functions(files, limit=3) == [f"{root / 'low/leaf.py'}:8 pkg.low.leaf.g: 4 lines"]
