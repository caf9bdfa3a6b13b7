"""The package's shape, read from its source alone (ast; nothing is imported): no import cycle,
no module importing one from a higher layer, no module over 400 lines, no function over 80.

Modules are found in the tree when the test runs, and every one must be given a layer in LAYERS,
so a new module forces a decision about where it belongs."""

from __future__ import annotations

import ast
import fnmatch
from dataclasses import dataclass
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]
PACKAGE = "rayexport"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80

# Lowest first. A module may import modules of its own layer and of lower ones, never of a higher
# one. Patterns are fnmatch's, matched against dotted module names (`*` spans dots too); a
# package's `__init__.py` is the package's own name.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation", (
        "rayexport.errors", "rayexport.dtypes", "rayexport.memory", "rayexport.scan", "rayexport.names",
        "rayexport.report", "rayexport.levels",
    )),
    ("storage", ("rayexport.storage", "rayexport.storage.*", "rayexport.storage_*")),
    # what every reader reports and the protocol layouts implement, below the planning that reads it
    ("sources", (
        "rayexport.layouts.shards", "rayexport.layouts.mapped", "rayexport.layouts.base", "rayexport.layouts.dcp_metadata",
    )),
    ("planning", (
        "rayexport.plan", "rayexport.plan.*", "rayexport.ties", "rayexport.lora", "rayexport.conversion",
        "rayexport.remote_code", "rayexport.model",
    )),
    # the layouts themselves: each spreads its checkpoint over the workers with planning's schedule
    ("layouts", ("rayexport.layouts", "rayexport.layouts.*")),
    ("transport and writing", ("rayexport.assembly", "rayexport.transport", "rayexport.writer", "rayexport.manifest")),
    ("verification", ("rayexport.verification", "rayexport.verification.*")),
    ("orchestration", (
        "rayexport.options", "rayexport.placement", "rayexport.pool", "rayexport.spool", "rayexport.workers",
        "rayexport.group", "rayexport.waits", "rayexport.session", "rayexport.nodes", "rayexport.export_plan", "rayexport.job",
    )),
    ("entry points", (
        "rayexport", "rayexport.__main__", "rayexport.run", "rayexport.remote", "rayexport.watch",
        "rayexport.verify", "rayexport.demo",
    )),
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


def layer_of(name: str, layers=LAYERS) -> list[int]:
    """The indices of the layers that claim the module `name` (one, when the table is right): a
    layer naming it exactly, else those whose wildcard patterns match it."""
    named = [index for index, (_, patterns) in enumerate(layers) if name in patterns]
    return named or [
        index for index, (_, patterns) in enumerate(layers) if any(fnmatch.fnmatchcase(name, p) for p in patterns)
    ]


def unassigned_modules(modules: dict[str, Module], layers=LAYERS) -> list[str]:
    """The modules that no layer, or more than one, claims."""
    problems = []
    for name in sorted(modules):
        claims = [layers[index][0] for index in layer_of(name, layers)]
        if len(claims) != 1:
            problems.append(f"{name} ({modules[name].where(1)}): " + (f"claimed by {', '.join(claims)}" if claims else "no layer"))
    return problems


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


def upward_imports(imports: list[Import], layers=LAYERS) -> list[str]:
    """Each import of a module from a higher layer than the importer's (modules without exactly
    one layer are `unassigned_modules`' to report)."""
    problems = []
    for edge in imports:
        own, target = layer_of(edge.module.name, layers), layer_of(edge.target, layers)
        if len(own) == 1 and len(target) == 1 and target[0] > own[0]:
            problems.append(
                f"{edge.module.where(edge.line)} {edge.module.name} ({layers[own[0]][0]}) imports "
                f"{edge.target} ({layers[target[0]][0]}): {edge.written}"
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


def test_every_module_has_one_layer(modules):
    _fail_listing(unassigned_modules(importable(modules)), "module(s) without exactly one layer in LAYERS")


def test_no_module_is_shadowed_by_a_package(modules):
    _fail_listing(shadowed_modules(modules), "file(s) Python never imports")


def test_the_import_graph_has_no_cycle(modules):
    _fail_listing(import_cycles(all_imports(importable(modules), PACKAGE)), "import cycle(s)")


def test_no_module_imports_a_higher_layer(modules):
    layers = " -> ".join(name for name, _ in LAYERS)
    _fail_listing(upward_imports(all_imports(importable(modules), PACKAGE)), f"upward import(s), layers lowest first: {layers}")


def test_no_module_is_over_the_limit(modules):
    _fail_listing(long_modules(modules), f"module(s) over {MAX_MODULE_LINES} lines")


def test_no_function_is_over_the_limit(modules):
    _fail_listing(long_functions(modules), f"function(s) over {MAX_FUNCTION_LINES} lines")


def test_the_checks_find_what_they_guard_against(tmp_path):
    """The checks on a small package of known faults: a relative import and one inside a
    function both count, a cycle is named with its imports, a module beside a package of its
    name is found, a decorator is not counted."""
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    sources = {
        "__init__.py": "",
        "low.py": "def f():\n    from pkg import high\n",
        "high.py": "from .low import f\n",
        "sub/__init__.py": "from . import leaf\n",
        "sub/leaf.py": "from .. import low\n" + "@staticmethod\n" * 5 + "def g():\n" + "    pass\n" * 3,
        "stray.py": "x = 1\n" * 12,
        "sub.py": "",
    }
    for name, text in sources.items():
        (root / name).write_text(text)
    layers = (("low", ("pkg.low", "pkg.sub", "pkg.sub.*")), ("high", ("pkg", "pkg.high")))
    files = find_modules(root, "pkg")
    modules = importable(files)
    imports = all_imports(modules, "pkg")

    assert {(edge.module.name, edge.line, edge.target) for edge in imports} == {
        ("pkg.low", 2, "pkg.high"), ("pkg.high", 1, "pkg.low"), ("pkg.sub", 1, "pkg.sub.leaf"), ("pkg.sub.leaf", 1, "pkg.low"),
    }
    assert unassigned_modules(modules, layers) == [f"pkg.stray ({root / 'stray.py'}:1): no layer"]
    [cycle] = import_cycles(imports)
    assert cycle.startswith("cycle among pkg.high, pkg.low:") and "low.py:2 pkg.low -> pkg.high: from pkg import high" in cycle
    assert upward_imports(imports, layers) == [f"{root / 'low.py'}:2 pkg.low (low) imports pkg.high (high): from pkg import high"]
    assert shadowed_modules(files) == [f"{root / 'sub.py'}:1 pkg.sub: shadowed by {root / 'sub/__init__.py'}:1"]
    assert long_modules(files, limit=10) == [f"{root / 'stray.py'}:1 pkg.stray: 12 lines"]
    assert long_functions(files, limit=3) == [f"{root / 'sub/leaf.py'}:7 pkg.sub.leaf.g: 4 lines"]
