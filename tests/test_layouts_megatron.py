"""rayexport.layouts.megatron: where a Megatron-Core torch_dist checkpoint is (its folder, verl's
`<step>/actor/` and `<ckpt>/model/`, Megatron-LM's save folder and tracker), whether its save has
finished, and one line for each way it is not one. The files are torch DCP saves of a few
Megatron-named tensors made here, with the `metadata.json` Megatron writes beside them;
tests/test_megatron.py reads Megatron-Core's own saves."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from rayexport.common.errors import ExportError
from rayexport.layouts.base import SourceSettings
from rayexport.layouts.megatron import MegatronLayout
from rayexport.layouts.registry import detect_layout, find_checkpoint, snapshot
from rayexport.storage.store import Store
from support.helpers import folder_with

TORCH_DIST = json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1})
STATE = {
    "embedding.word_embeddings.weight": torch.ones(8, 4),
    "decoder.layers.self_attention.linear_qkv.weight": torch.ones(2, 12, 4),
    "decoder.final_layernorm.weight": torch.ones(4),
}


def torch_dist(folder, state=STATE, config=TORCH_DIST):
    """A torch_dist folder: DCP files of `state`, then Megatron's metadata.json (None: not yet)."""
    folder.mkdir(parents=True, exist_ok=True)
    dcp.save(dict(state), checkpoint_id=str(folder), no_dist=True)
    if config is not None:
        (folder / "metadata.json").write_text(config)
    return Store(str(folder))


def test_each_form_of_the_source_is_found_with_its_hugging_face_folder(tmp_path):
    verl = tmp_path / "global_step_2" / "actor"
    torch_dist(verl / "dist_ckpt")
    folder_with(verl / "huggingface", {"config.json": "{}"})
    megatron_lm = tmp_path / "save"
    torch_dist(megatron_lm / "iter_0000002")
    folder_with(megatron_lm, {"latest_checkpointed_iteration.txt": "2\n"})
    for source, files, hf in (
        (verl, verl / "dist_ckpt", verl / "huggingface"),
        (verl / "dist_ckpt", verl / "dist_ckpt", verl / "huggingface"),
        (megatron_lm, megatron_lm / "iter_0000002", megatron_lm / "huggingface"),
    ):
        store = Store(str(source))
        assert detect_layout(store).name == "megatron", source
        checkpoint = find_checkpoint(store, "auto", SourceSettings())
        assert checkpoint.layout == "megatron" and checkpoint.store.uri == str(files)
        assert checkpoint.hf_folder.uri == str(hf)
        assert sorted(checkpoint.tensors) == sorted(STATE) and checkpoint.producer_namings is not None


def test_a_release_folder_is_read_where_the_tracker_says_release(tmp_path):
    torch_dist(tmp_path / "release")
    folder_with(tmp_path, {"latest_checkpointed_iteration.txt": "release"})
    assert find_checkpoint(Store(str(tmp_path)), "megatron", SourceSettings()).store.uri == str(tmp_path / "release")


def test_step_chooses_an_iteration_other_than_the_tracked_one(tmp_path):
    for iteration in (100, 200):
        torch_dist(tmp_path / f"iter_{iteration:07d}")
    folder_with(tmp_path, {"latest_checkpointed_iteration.txt": "200"})
    store = Store(str(tmp_path))
    assert find_checkpoint(store, "auto", SourceSettings()).store.uri == str(tmp_path / "iter_0000200")
    assert find_checkpoint(store, "auto", SourceSettings(step=100)).store.uri == str(tmp_path / "iter_0000100")
    with pytest.raises(ExportError, match=r"--step names iteration 150, but '.*iter_0000150/' holds no checkpoint \(there: iter_0000100, iter_0000200\)"):
        find_checkpoint(store, "auto", SourceSettings(step=150))


def test_a_tracker_naming_what_is_not_there_is_one_line(tmp_path):
    folder_with(tmp_path, {"latest_checkpointed_iteration.txt": "300"})
    with pytest.raises(ExportError, match=r"names iteration 300, but '.*iter_0000300/' holds no checkpoint"):
        find_checkpoint(Store(str(tmp_path)), "auto", SourceSettings())
    folder_with(tmp_path, {"latest_checkpointed_iteration.txt": "latest, probably"})
    with pytest.raises(ExportError, match="holds 'latest, probably', not an iteration number or 'release'"):
        find_checkpoint(Store(str(tmp_path)), "auto", SourceSettings())


def test_another_backend_or_other_names_are_refused_in_one_line(tmp_path):
    zarr = torch_dist(tmp_path / "zarr", config=json.dumps({"sharded_backend": "zarr"}))
    assert detect_layout(zarr).name == "dcp"  # not a torch_dist save: auto reads it as plain DCP
    with pytest.raises(ExportError, match="names sharded backend 'zarr'; rayexport reads Megatron-Core's torch_dist"):
        find_checkpoint(zarr, "megatron", SourceSettings())
    hf_names = torch_dist(tmp_path / "hf", {"model.embed_tokens.weight": torch.ones(8, 4)})
    with pytest.raises(ExportError, match="holds no tensor under Megatron-Core's names \\(first: 'model.embed_tokens.weight'\\)"):
        find_checkpoint(hf_names, "auto", SourceSettings())
    with pytest.raises(ExportError, match="no Megatron-Core checkpoint at .*: no 'metadata.json', 'dist_ckpt/' or 'latest_checkpointed"):
        find_checkpoint(folder_with(tmp_path / "empty", {"notes.txt": "x"}), "megatron", SourceSettings())
    with pytest.raises(ExportError, match="missing '.*plain/metadata.json', the config Megatron-Core's save writes last"):
        find_checkpoint(torch_dist(tmp_path / "plain", config=None), "megatron", SourceSettings())


def test_the_watcher_waits_for_metadata_json(tmp_path):
    actor = tmp_path / "actor"
    torch_dist(actor / "dist_ckpt", config=None)
    assert snapshot(Store(str(actor))) is None  # dist_ckpt/ has no metadata.json yet: detect fails
    assert MegatronLayout().snapshot(Store(str(actor / "dist_ckpt")), Store(str(actor / "dist_ckpt")).list()) is None
    (actor / "dist_ckpt" / "metadata.json").write_text(TORCH_DIST)
    found = snapshot(Store(str(actor)))
    assert set(found) == {"dist_ckpt/.metadata", "dist_ckpt/__0_0.distcp", "dist_ckpt/metadata.json"}
    assert found["dist_ckpt/metadata.json"] == len(TORCH_DIST)


def test_megatrons_record_of_each_ranks_save_plan_is_read(tmp_path):
    """Megatron-Core's save keeps every rank's SavePlan in the metadata (`all_local_plans`), torch
    classes that a reader of DCP metadata must allow, and nothing else."""
    store = torch_dist(tmp_path / "dist_ckpt")
    path = tmp_path / "dist_ckpt" / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    item = WriteItem(MetadataIndex("decoder.final_layernorm.weight"), WriteItemType.SHARD, TensorWriteData(None, None, torch.Size([4])))
    metadata.all_local_plans = [SavePlan([item])]
    path.write_bytes(pickle.dumps(metadata))
    assert "decoder.final_layernorm.weight" in find_checkpoint(store, "auto", SourceSettings()).tensors
