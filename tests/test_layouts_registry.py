"""rayexport.layouts.registry: which layout a source folder holds, whether its trainer has
finished writing it (what the watcher waits for), and `--layout` by name. Files are made by
hand: only their names and sizes matter here."""

from __future__ import annotations

import pytest
from support.helpers import folder_with

from rayexport.common.errors import ExportError
from rayexport.layouts.base import SourceSettings
from rayexport.layouts.registry import LAYOUT_NAMES, LAYOUTS, detect_layout, find_checkpoint, layout_named, snapshot


def test_each_layout_is_detected_from_its_files(tmp_path):
    verl = folder_with(tmp_path / "verl", {"model_world_size_2_rank_0.pt": b"x", "model_world_size_2_rank_1.pt": b"x"})
    dcp = folder_with(tmp_path / "dcp", {"__0_0.distcp": b"x", ".metadata": b"x"})
    trainer = folder_with(tmp_path / "checkpoint-500", {"pytorch_model_fsdp_0/__0_0.distcp": b"x", "optimizer_0/x": b"x"})
    deepspeed = folder_with(tmp_path / "checkpoint-2", {"latest": b"global_step2", "zero_to_fp32.py": b"x"})
    assert [detect_layout(store).name for store in (verl, dcp, trainer, deepspeed)] == ["verl", "dcp", "accelerate", "deepspeed"]
    assert detect_layout(folder_with(tmp_path / "other", {"notes.txt": b"x"})) is None
    assert LAYOUT_NAMES == ("auto", "megatron", "deepspeed", "torchtitan", "dcp", "verl", "accelerate", "hf-sharded")
    assert LAYOUT_NAMES[1:] == tuple(layout.name for layout in LAYOUTS)  # --layout's choices are the readers'


def test_the_watcher_waits_for_each_layouts_completion_marker(tmp_path):
    verl = folder_with(tmp_path / "verl", {"model_world_size_1_rank_0.pt": b"abc"})
    assert snapshot(verl) is None  # verl writes fsdp_config.json last
    folder_with(tmp_path / "verl", {"fsdp_config.json": b"{}"})
    assert snapshot(verl) == {"model_world_size_1_rank_0.pt": 3, "fsdp_config.json": 2}

    trainer = folder_with(tmp_path / "checkpoint-500", {"pytorch_model_fsdp_0/__0_0.distcp": b"abcd", "trainer_state.json": b"{}"})
    assert snapshot(trainer) is None  # its model folder has no .metadata yet
    folder_with(tmp_path / "checkpoint-500", {"pytorch_model_fsdp_0/.metadata": b"m"})
    assert snapshot(trainer) == {"pytorch_model_fsdp_0/__0_0.distcp": 4, "pytorch_model_fsdp_0/.metadata": 1}
    assert snapshot(folder_with(tmp_path / "empty", {})) is None

    deepspeed = folder_with(tmp_path / "checkpoint-2", {"global_step2/zero_pp_rank_0_mp_rank_00_model_states.pt": b"ab",
                                                         "zero_to_fp32.py": b"x"})
    assert snapshot(deepspeed) is None  # DeepSpeed writes `latest` once every rank has saved
    folder_with(tmp_path / "checkpoint-2", {"latest": b"global_step2"})
    assert snapshot(deepspeed) == {"global_step2/zero_pp_rank_0_mp_rank_00_model_states.pt": 2}


def test_an_unknown_layout_is_one_line_naming_the_known_ones():
    with pytest.raises(ExportError, match=r"unknown layout 'bogus' \(known: auto, megatron, deepspeed, torchtitan, dcp, verl, accelerate, hf-sharded\)"):
        layout_named("bogus")


def test_a_named_layout_reads_the_folder_even_when_auto_would_not(tmp_path):
    store = folder_with(tmp_path / "ckpt", {"model_world_size_2_rank_0.pt": b"x", "model_world_size_2_rank_1.pt": b"x"})
    with pytest.raises(ExportError, match="no DCP metadata file"):
        find_checkpoint(store, "dcp", SourceSettings())
    with pytest.raises(ExportError, match="no accelerate model folder"):
        find_checkpoint(store, "accelerate", SourceSettings())
    with pytest.raises(ExportError, match="missing rank file '.*model_world_size_2_rank_1.pt'"):
        find_checkpoint(folder_with(tmp_path / "half", {"model_world_size_2_rank_0.pt": b"x"}), "auto", SourceSettings())
