"""The sharded HF safetensors layout against real `HuggingFaceStorageWriter(save_distributed=True)`
output of 2 FSDP2 gloo ranks (a tied Qwen2-style model, uneven shards, 2 files per rank):
detection, description from the headers, each rank read alone, the watcher's completion
markers, where config and tokenizer come from, and one-line errors for what is missing."""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch
from safetensors.torch import save_file
from test_storage_nodes import FolderNodes
from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

from rayexport.common.errors import ExportError
from rayexport.layouts.base import SourceSettings
from rayexport.layouts.hf_sharded import find_sharded_checkpoint
from rayexport.layouts.mapped import mapped_ranges
from rayexport.layouts.registry import detect_layout, find_checkpoint, snapshot
from rayexport.model.description import hf_folder
from rayexport.orchestration.nodes import files_below
from rayexport.plan.pieces import tensor_pieces
from rayexport.storage.nodes import NodeFiles, node_labels, spread_store
from rayexport.storage.store import Store
from support.models import tiny_config, write_hf_folder

RANK_FILES = (
    ("shard-00001-model-00001-of-00002.safetensors", "shard-00001-model-00002-of-00002.safetensors"),
    ("shard-00002-model-00001-of-00002.safetensors", "shard-00002-model-00002-of-00002.safetensors"),
)


@pytest.fixture(scope="module")
def written(hf_sharded_checkpoints):
    """torchtitan's place for them: `step-10/sharded/`."""
    return hf_sharded_checkpoints["titan"]


@pytest.fixture
def source(written, tmp_path):
    """A copy of the checkpoint to damage, at `<tmp>/step-10/sharded`."""
    return shutil.copytree(written.path, tmp_path / "step-10" / "sharded")


def describe(path) -> object:
    return find_checkpoint(Store(str(path)), "auto", SourceSettings())


def test_a_sharded_folder_is_detected_and_described_from_its_headers(written):
    store = Store(written.path)
    assert detect_layout(store).name == "hf-sharded"
    checkpoint = describe(written.path)
    assert checkpoint.layout == "hf-sharded" and checkpoint.world_size == 2
    assert checkpoint.rank_files == RANK_FILES
    assert checkpoint.shapes == {key: tuple(tensor.shape) for key, tensor in written.reference_state.items()}
    assert checkpoint.read_files() == {name: os.path.getsize(os.path.join(written.path, name)) for name in sum(RANK_FILES, ())}
    assert checkpoint.hf_folder.uri == os.path.join(os.path.dirname(written.path), "huggingface")
    assert find_checkpoint(store, "hf-sharded", SourceSettings()).rank_files == RANK_FILES


def test_each_rank_read_alone_assembles_the_original_from_its_mapped_files(written, tmp_path):
    checkpoint = find_sharded_checkpoint(Store(written.path))
    states = {}

    def load(parts):
        infos = {}
        for part in parts.values():
            for rank, tensors in checkpoint.read(part, str(tmp_path), lambda count: None).items():
                states[rank], infos[rank] = tensors, tensors.describe()
        return infos

    loaded = checkpoint.share(2, {}, load)
    assert loaded.worker_of_rank == {0: 0, 1: 1}
    assert checkpoint.describe_part([0, 1]) == loaded.rank_infos  # --dry-run's, from the headers alone
    for rank, files in enumerate(RANK_FILES):
        mapped = states[rank].mapped_ranges()
        assert mapped == [span for name in files for span in mapped_ranges(os.path.join(written.path, name))]
        tensor = states[rank]["model.embed_tokens.weight"]
        assert any(start <= tensor.data_ptr() < end for start, end in mapped)  # a view of the file, no copy
    for key, expected in written.reference_state.items():
        assembled = torch.full_like(expected, float("nan"))
        for piece in tensor_pieces(key, loaded.holders[key], tuple(expected.shape)):
            assembled[tuple(slice(start, start + size) for start, size in zip(piece.offset, piece.shape))] = states[piece.rank][key]
        torch.testing.assert_close(assembled, expected, rtol=0, atol=0)


def test_a_missing_rank_file_is_one_line_naming_it(source):
    for name in RANK_FILES[0]:
        os.remove(source / name)
    with pytest.raises(ExportError) as caught:
        describe(source)
    assert str(caught.value) == f"missing rank file '{source}/shard-00001-model-00001-of-00002.safetensors'"


def test_pieces_that_do_not_cover_a_tensor_name_it(source, written):
    os.remove(source / RANK_FILES[0][1])  # rank 0's half of the tensors in file 2
    with pytest.raises(ExportError) as caught:
        describe(source)
    match = re.fullmatch(r"tensor '([^']+)' pieces cover (\d+) of its (\d+) elements \[[\d, ]+\]", str(caught.value))
    assert match, str(caught.value)
    key, covered, total = match.group(1), int(match.group(2)), int(match.group(3))
    assert key in sorted(written.reference_state)[1::2] and covered < total == written.reference_state[key].numel()


def test_overlapping_pieces_name_the_tensor_and_both_files(source):
    for name in RANK_FILES[1]:  # a third rank holding exactly what the second holds
        shutil.copy(source / name, source / name.replace("shard-00002", "shard-00003"))
    with pytest.raises(ExportError, match=r"^tensor '[^']+' has overlapping pieces in 'shard-00002-model-0000\d-of-00002.safetensors' "
                                          r"and 'shard-00003-model-0000\d-of-00002.safetensors'$"):
        describe(source)


def test_a_file_the_sharded_writer_did_not_write_is_named(tmp_path):
    save_file({"w": torch.zeros(2, 2)}, str(tmp_path / "shard-00001-model-00001-of-00001.safetensors"))
    with pytest.raises(ExportError, match=r"^'.*/shard-00001-model-00001-of-00001.safetensors' records no piece offsets"):
        describe(tmp_path)


def test_rank_files_spread_over_nodes_are_placed_by_where_they_are(written, tmp_path):
    disks = {"a": tmp_path / "a", "b": tmp_path / "b"}
    for node, files in zip(disks, RANK_FILES):
        disks[node].mkdir()
        for name in files:
            shutil.copy(os.path.join(written.path, name), disks[node] / name)
    labels = node_labels({"a": "10.0.0.1", "b": "10.0.0.2"})
    nodes = [NodeFiles(node, labels[node], files_below(str(disk))) for node, disk in disks.items()]
    view = str(tmp_path / "view")
    on_node = FolderNodes(view, {node: str(disk) for node, disk in disks.items()})
    checkpoint = find_sharded_checkpoint(spread_store(Store(view), nodes, on_node))
    assert checkpoint.world_size == 2 and checkpoint.shapes["lm_head.weight"] == (1001, 32)
    loaded = checkpoint.share(2, {}, lambda parts: {rank: {} for part in parts.values() for rank in part},
                              file_readers={name: rank for rank, files in enumerate(RANK_FILES) for name in files})
    assert loaded.worker_of_rank == {0: 0, 1: 1}

    os.rename(disks["b"], disks["b"].with_name("c"))
    disks["b"].mkdir()
    for name in RANK_FILES[1]:  # node b now holds only a third rank's files
        shutil.copy(disks["b"].with_name("c") / name, disks["b"] / name.replace("shard-00002", "shard-00003"))
    nodes = [NodeFiles(node, labels[node], files_below(str(disk))) for node, disk in disks.items()]
    with pytest.raises(ExportError) as caught:
        find_sharded_checkpoint(spread_store(Store(view), nodes, on_node))
    assert str(caught.value) == (
        "rank file of rank 1 of world size 3 (shard-00002-*) is on no node of this cluster (asked 2 nodes: 10.0.0.1, 10.0.0.2)"
    )


@pytest.mark.parametrize("marker", ["merged-index", "automodel-consolidated", "automodel-step"])
def test_the_watcher_waits_until_the_save_is_marked_complete(source, marker):
    store = Store(str(source))
    assert snapshot(store) is None  # the writer itself leaves no marker
    if marker == "merged-index":  # torch's consolidation, as torchtitan's last_save_in_hf runs it
        consolidate_safetensors_files(str(source), str(source.parent), dict.fromkeys(describe(source).shapes, 1))
    elif marker == "automodel-consolidated":
        (source / "consolidated").mkdir()
        (source / "consolidated" / "model.safetensors.index.json").write_text("{}")
    else:
        (source.parent / "config.yaml").write_text("step: 10\n")
    assert snapshot(store) == {name: os.path.getsize(source / name) for name in sum(RANK_FILES, ())}


def test_config_and_tokenizer_come_from_huggingface_beside_then_hf_config_then_automodels_folder(source, tmp_path):
    with pytest.raises(ExportError) as caught:
        hf_folder(describe(source).hf_folder, None, describe(source).nearby_hf_folder, None)
    assert str(caught.value) == (
        f"missing '{source.parent}/huggingface/config.json': "
        "pass --hf-config URI (a folder with the model's config.json and tokenizer) or --base-model"
    )
    config = tiny_config("qwen2-tied", vocab_size=1001)
    write_hf_folder(config, str(source / ".hf_metadata"))  # NeMo Automodel's copy of them
    checkpoint = describe(source)
    assert hf_folder(checkpoint.hf_folder, None, checkpoint.nearby_hf_folder, None).uri == f"{source}/.hf_metadata"
    write_hf_folder(config, str(tmp_path / "hf"))
    assert hf_folder(checkpoint.hf_folder, Store(str(tmp_path / "hf")), checkpoint.nearby_hf_folder, None).uri == str(tmp_path / "hf")
    write_hf_folder(config, str(source.parent / "huggingface"))
    assert hf_folder(describe(source).hf_folder, None, None, None).uri == f"{source.parent}/huggingface"
