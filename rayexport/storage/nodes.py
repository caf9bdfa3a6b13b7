"""Local paths on a cluster whose nodes each have a disk of their own: a source whose files are
spread over the nodes (`SpreadStore`: verl's default on a multi-node run without a shared
filesystem), and a destination on one node reached from any other (`PinnedStore`).

Both are `Store`s, so the layouts, the model description and the manifest read them like any
other. What runs a call on another node is handed in (`OnNode`): Ray stays in orchestration."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any, Protocol

from rayexport.common.errors import ExportError
from rayexport.storage.store import Store


class OnNode(Protocol):
    """Runs a `Store` method on a given node of the cluster."""

    def here(self) -> str | None:
        """The id of the node whose files this process sees, None where that is not known."""

    def call(self, node: str, store: Store, method: str, *args: Any) -> Any:
        """`getattr(store, method)(*args)`, run on `node`."""


@dataclass(frozen=True)
class NodeFiles:
    """What one node holds under a local path: each file's path below it and size."""

    node: str  # the node's id
    label: str  # how messages name it: its address, and its id where addresses repeat
    files: dict[str, int]


def node_labels(addresses: dict[str, str]) -> dict[str, str]:
    """How messages name each node (id -> address): by address, with the start of its id where
    two nodes share an address (several nodes on one machine)."""
    repeated = {address for address in addresses.values() if list(addresses.values()).count(address) > 1}
    return {node: f"{address} (node {node[:8]})" if address in repeated else address for node, address in addresses.items()}


def asked_text(nodes: list[NodeFiles]) -> str:
    """'asked 2 nodes: a, b', for messages about files no node holds."""
    return f"asked {len(nodes)} node{'s' if len(nodes) != 1 else ''}: " + ", ".join(node.label for node in nodes)


def spread_store(store: Store, nodes: list[NodeFiles], on_node: OnNode) -> Store:
    """The local path `store` as the nodes of a cluster see it: `store` itself when every node
    holds the same files (a shared filesystem, or one node), else a `SpreadStore`. A file that
    two nodes hold with different sizes is refused, naming both."""
    sizes: dict[str, dict[str, int]] = {}
    for node in nodes:
        for name, size in node.files.items():
            sizes.setdefault(name, {})[node.label] = size
    for name, by_node in sorted(sizes.items()):
        if len(set(by_node.values())) > 1:
            held = ", ".join(f"{size} bytes on {label}" for label, size in by_node.items())
            raise ExportError(f"'{store.display(name)}' differs between nodes: {held}")
    if len(nodes) < 2 or all(node.files.keys() == nodes[0].files.keys() for node in nodes):
        return store
    return SpreadStore(store.uri, store.options, tuple(nodes), on_node)


class SpreadStore(Store):
    """A local path whose files are spread over the nodes of a cluster, read-only: listed as the
    union of what every node holds, and each file read from a node that holds it (this one
    first). Workers reading whole files are placed on their files' nodes (`holders`)."""

    def __init__(self, uri: str, options: dict[str, Any], nodes: tuple[NodeFiles, ...], on_node: OnNode,
                 below: str = "") -> None:
        super().__init__(uri, options)
        self.nodes, self.on_node, self.below = nodes, on_node, below

    def __reduce__(self):
        return SpreadStore, (self.uri, self.options, self.nodes, self.on_node, self.below)

    def _full(self, name: str) -> str:
        return posixpath.join(self.below, name) if name else self.below

    def holders(self, name: str) -> tuple[str, ...]:
        """The ids of the nodes that hold the file `name`."""
        full = self._full(name)
        return tuple(node.node for node in self.nodes if full in node.files)

    def asked(self) -> str:
        return asked_text(list(self.nodes))

    def nowhere(self) -> str:
        return f"on no node of this cluster ({self.asked()})"

    def child(self, name: str) -> "SpreadStore":
        return SpreadStore(
            self.uri.rstrip("/") + "/" + name.strip("/"), self.options, self.nodes, self.on_node, self._full(name.strip("/"))
        )

    def find(self, name: str = "") -> list[str]:
        prefix = self._full(name) + "/" if self._full(name) else ""
        return sorted({path[len(prefix):] for node in self.nodes for path in node.files if path.startswith(prefix)})

    def _entries(self, name: str, kind: str) -> list[str]:
        below = self.find(name)
        if kind == "file":
            return sorted(path for path in below if "/" not in path)
        return sorted({path.split("/", 1)[0] for path in below if "/" in path})

    def exists(self, name: str = "") -> bool:
        full = self._full(name)
        return not full or any(full in node.files for node in self.nodes) or bool(self.find(name))

    def size(self, name: str) -> int:
        full = self._full(name)
        for node in self.nodes:
            if full in node.files:
                return node.files[full]
        raise ExportError(f"not found: '{self.display(name)}' ({self.asked()})")

    def version(self, name: str) -> tuple:
        return self._on_holder("version", name)

    def read_bytes(self, name: str) -> bytes:
        return self._on_holder("read_bytes", name)

    def read_range(self, name: str, start: int, end: int) -> bytes:
        return self._on_holder("read_range", name, start, end)

    def _on_holder(self, method: str, name: str, *args: Any) -> Any:
        holders = self.holders(name)
        if not holders:
            raise ExportError(f"not found: '{self.display(name)}' ({self.asked()})")
        here = self.on_node.here()
        if here in holders:
            return getattr(Store(self.uri, self.options), method)(name, *args)
        return self.on_node.call(holders[0], Store(self.uri, self.options), method, name, *args)


class PinnedStore(Store):
    """A local path on one node (`node`), reached from any node: on that node it is a plain
    local store; elsewhere each call runs there. Streaming writes (`writer`) happen only there."""

    def __init__(self, uri: str, options: dict[str, Any], node: str, label: str, on_node: OnNode) -> None:
        super().__init__(uri, options)
        self.node, self.label, self.on_node = node, label, on_node

    def __reduce__(self):
        return PinnedStore, (self.uri, self.options, self.node, self.label, self.on_node)

    def child(self, name: str) -> "PinnedStore":
        return PinnedStore(self.uri.rstrip("/") + "/" + name.strip("/"), self.options, self.node, self.label, self.on_node)

    def _plain(self) -> Store:
        return Store(self.uri, self.options)

    def _run(self, method: str, *args: Any) -> Any:
        if self.on_node.here() == self.node:
            return getattr(self._plain(), method)(*args)
        return self.on_node.call(self.node, self._plain(), method, *args)

    def exists(self, name: str = "") -> bool:
        return self._run("exists", name)

    def _entries(self, name: str, kind: str) -> list[str]:
        return self._run("list" if kind == "file" else "folders", name)

    def find(self, name: str = "") -> list[str]:
        return self._run("find", name)

    def size(self, name: str) -> int:
        return self._run("size", name)

    def version(self, name: str) -> tuple:
        return self._run("version", name)

    def read_bytes(self, name: str) -> bytes:
        return self._run("read_bytes", name)

    def read_range(self, name: str, start: int, end: int) -> bytes:
        return self._run("read_range", name, start, end)

    def write_bytes(self, name: str, data: bytes) -> None:
        self._run("write_bytes", name, data)

    def delete(self, name: str) -> None:
        self._run("delete", name)

    def create_exclusive(self, name: str, data: bytes) -> bool:
        return self._run("create_exclusive", name, data)

    def writer(self, name: str):
        if self.on_node.here() != self.node:
            raise ExportError(f"'{self.display(name)}' is on node {self.label}: it is written there only")
        return self._plain().writer(name)
