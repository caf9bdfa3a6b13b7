"""rayexport.storage.nodes: a local path as the nodes of a cluster see it. Each "node" here is a
folder of its own and `FolderNodes` runs a call in the folder of the node named (what Ray's pinned
tasks do on a real cluster: tests/test_node_local.py)."""

from __future__ import annotations

import pytest

from rayexport.common.errors import ExportError
from rayexport.orchestration.nodes import files_below
from rayexport.storage.nodes import NodeFiles, PinnedStore, SpreadStore, node_labels, spread_store
from rayexport.storage.store import Store


class FolderNodes:
    """Node id -> the folder that node's disk shows at the shared path `view`; this process is
    no node."""

    def __init__(self, view: str, folders: dict[str, str]) -> None:
        self.view, self.folders = view, folders

    def here(self) -> None:
        return None

    def call(self, node: str, store: Store, method: str, *args):
        return getattr(Store(store.uri.replace(self.view, self.folders[node], 1), store.options), method)(*args)


@pytest.fixture
def two_nodes(tmp_path):
    disks = {"a": tmp_path / "a", "b": tmp_path / "b"}
    for node, files in {"a": {"rank_0.pt": b"0" * 10, "huggingface/config.json": b"{}"}, "b": {"rank_1.pt": b"1" * 20}}.items():
        for name, data in files.items():
            (disks[node] / name).parent.mkdir(parents=True, exist_ok=True)
            (disks[node] / name).write_bytes(data)
    labels = node_labels({"a": "10.0.0.1", "b": "10.0.0.2"})
    nodes = [NodeFiles(node, labels[node], files_below(str(disk))) for node, disk in disks.items()]
    view = str(tmp_path / "view")
    return Store(view), nodes, FolderNodes(view, {node: str(disk) for node, disk in disks.items()})


def test_a_spread_folder_lists_the_union_and_reads_each_file_where_it_is(two_nodes):
    store, nodes, on_node = two_nodes
    spread = spread_store(store, nodes, on_node)
    assert isinstance(spread, SpreadStore)
    assert spread.list() == ["rank_0.pt", "rank_1.pt"] and spread.folders() == ["huggingface"]
    assert spread.size("rank_1.pt") == 20 and spread.holders("rank_1.pt") == ("b",)
    assert spread.read_bytes("rank_1.pt") == b"1" * 20
    hf = spread.child("huggingface")
    assert hf.find() == ["config.json"] and hf.read_bytes("config.json") == b"{}" and hf.holders("config.json") == ("a",)
    assert spread.nowhere() == "on no node of this cluster (asked 2 nodes: 10.0.0.1, 10.0.0.2)"
    with pytest.raises(ExportError, match=r"not found: '.*/view/rank_2.pt' \(asked 2 nodes"):
        spread.read_bytes("rank_2.pt")


def test_the_same_files_on_every_node_are_a_shared_folder(two_nodes):
    store, nodes, on_node = two_nodes
    same = [NodeFiles(node.node, node.label, nodes[0].files) for node in nodes]
    assert spread_store(store, same, on_node) is store
    assert spread_store(store, nodes[:1], on_node) is store


def test_a_file_whose_size_differs_between_nodes_is_one_line_naming_both(two_nodes):
    store, nodes, on_node = two_nodes
    differing = [nodes[0], NodeFiles("b", nodes[1].label, {**nodes[1].files, "rank_0.pt": 9})]
    with pytest.raises(ExportError, match=r"^'.*/view/rank_0.pt' differs between nodes: 10 bytes on 10.0.0.1, 9 bytes on 10.0.0.2$"):
        spread_store(store, differing, on_node)


def test_nodes_sharing_an_address_are_told_apart_by_id():
    assert node_labels({"abcdef0123": "10.0.0.1", "9876543210": "10.0.0.1", "x": "10.0.0.2"}) == {
        "abcdef0123": "10.0.0.1 (node abcdef01)", "9876543210": "10.0.0.1 (node 98765432)", "x": "10.0.0.2",
    }


def test_a_pinned_folder_is_read_and_written_on_its_node_only(tmp_path):
    on_node = FolderNodes(str(tmp_path / "view"), {"a": str(tmp_path / "disk-a")})
    pinned = PinnedStore(str(tmp_path / "view"), {}, "a", "10.0.0.1", on_node)
    pinned.write_json("export_manifest.json", {"ok": True})
    assert (tmp_path / "disk-a" / "export_manifest.json").exists() and not (tmp_path / "view").exists()
    assert pinned.exists("export_manifest.json") and pinned.read_json("export_manifest.json") == {"ok": True}
    assert pinned.list() == ["export_manifest.json"] and pinned.node == "a"
    with pytest.raises(ExportError, match="is on node 10.0.0.1: it is written there only"):
        with pinned.writer("model.safetensors"):
            pass
