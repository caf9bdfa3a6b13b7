"""Tracing conversions on the meta device: the tiles of each converted tensor rebuild exactly
what the conversion computes on real tensors, and anything else is refused by op name."""

import pytest
import torch

from rayexport.common.errors import ExportError
from rayexport.model.conversion import model_formats, trace
from rayexport.model.description import build_meta_model, expected_tensors
from rayexport.plan.ties import find_tie_aliases
from test_plan_tiles import rebuild


def moves(state):
    fused, table = state["fused"], state["table"]
    gate, up = torch.chunk(fused, 2, dim=1)
    out = {f"experts.{i}.up": expert.contiguous() for i, expert in enumerate(torch.unbind(up, 0))}
    out.update({f"experts.{i}.gate": expert.squeeze(0) for i, expert in enumerate(gate.split(1, 0))})
    out["stacked"] = torch.stack([table.t(), table.t()], dim=2)
    out["joined"] = torch.cat([table, table[1:3]], 0).reshape(1, 7, 3)
    return out


def test_traced_tiles_rebuild_what_the_conversion_computes():
    real = {"fused": torch.randn(3, 4, 5), "table": torch.randn(5, 3)}
    traced = trace(moves, {"fused": ((3, 4, 5), "float32"), "table": ((5, 3), "float32")}, "the test's conversion")
    computed = moves(real)
    assert set(traced) == set(computed)
    for name, (shape, dtype, tiles) in traced.items():
        assert shape == tuple(computed[name].shape) and dtype == "float32"
        torch.testing.assert_close(rebuild(tiles, real, shape), computed[name])


def test_an_op_that_is_not_a_move_is_refused_by_name():
    with pytest.raises(ExportError, match=r"the test's conversion makes 'scaled' with aten\.mul"):
        trace(lambda state: {"scaled": state["w"] * 2}, {"w": ((2, 2), "float32")}, "the test's conversion")


def test_qwen3_moe_on_disk_experts_are_boxes_of_the_fused_tensors():
    from support.models import tiny_format_config

    model = build_meta_model(tiny_format_config("qwen3_moe"), False)
    formats = model_formats(model, expected_tensors(model), find_tie_aliases(model))
    tiles = formats.disk_tiles["model.layers.1.mlp.experts.3.up_proj.weight"]
    assert [(tile.source, tile.source_offset, tile.source_shape) for tile in tiles] == [
        ("model.layers.1.mlp.experts.gate_up_proj", (3, 32, 0), (1, 32, 64))
    ]
    assert formats.disk.expected["model.layers.1.mlp.experts.3.down_proj.weight"] == ((64, 32), "float32")
    assert "model.layers.1.mlp.experts.gate_up_proj" not in formats.disk.expected
    assert formats.renamed["model.layers.0.self_attn.q_proj.weight"] == "model.layers.0.self_attn.q_proj.weight"


def test_a_vlm_tie_declared_in_text_config_is_found_in_both_namings():
    from support.models import tiny_format_config

    model = build_meta_model(tiny_format_config("qwen2_5_vl"), False)
    formats = model_formats(model, expected_tensors(model), find_tie_aliases(model))
    assert formats.memory.aliases == {"lm_head.weight": "model.language_model.embed_tokens.weight"}
    assert formats.disk.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "visual.blocks.0.attn.qkv.weight" in formats.disk.expected
