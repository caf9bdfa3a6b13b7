"""Which Megatron-Core parameter each Hugging Face tensor of a model comes from, and how: tables
of rows, by Hugging Face architecture. Data, not code paths: a new architecture is a table.

Megatron-Bridge's own mapping registries give almost every table (`megatron_bridge_tables.json`,
which tools/megatron_bridge_tables.py generates from them; rerun it when Megatron-Bridge
releases). mbridge, verl's older bridge, maps a few models Megatron-Bridge does not, and names
Qwen2.5-VL's vision tower its own way: those rows are written out here (`MBRIDGE_TABLES`).

A row is (kind, Megatron-Core parameter pattern, Hugging Face name pattern or patterns by part,
options): `*` stands for a number, `**` for any name, `{mtp}` for a multi-token-prediction layer
and `{layers+mtp}` for the decoder layer after the last that Hugging Face names it by. The kind
says how the Hugging Face tensor is cut from the parameter (`rayexport.plan.megatron_cuts`).
"""

from __future__ import annotations

import functools
import json
import os
import re

from rayexport.common.errors import ExportError

Row = tuple  # (kind, Megatron-Core parameter pattern, Hugging Face pattern or {part: pattern}, options)
BRIDGE_TABLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_bridge_tables.json")

_MOE = "decoder.layers.*.mlp."
MBRIDGE_TABLES: dict[str, tuple[Row, ...]] = {
    "MixtralForCausalLM": (
        ("direct", "embedding.word_embeddings.weight", "model.embed_tokens.weight", {}),
        ("direct", "output_layer.weight", "lm_head.weight", {}),
        ("direct", "decoder.final_layernorm.weight", "model.norm.weight", {}),
        ("direct", "decoder.layers.*.self_attention.linear_qkv.layer_norm_weight", "model.layers.*.input_layernorm.weight", {}),
        ("qkv", "decoder.layers.*.self_attention.linear_qkv.weight",
         {part: f"model.layers.*.self_attn.{part}_proj.weight" for part in "qkv"}, {}),
        ("direct", "decoder.layers.*.self_attention.linear_proj.weight", "model.layers.*.self_attn.o_proj.weight", {}),
        ("direct", "decoder.layers.*.pre_mlp_layernorm.weight", "model.layers.*.post_attention_layernorm.weight", {}),
        ("direct", _MOE + "router.weight", "model.layers.*.block_sparse_moe.gate.weight", {}),
        ("gated_mlp", _MOE + "experts.linear_fc1.weight*",
         {"gate": "model.layers.*.block_sparse_moe.experts.*.w1.weight",
          "up": "model.layers.*.block_sparse_moe.experts.*.w3.weight"}, {}),
        ("direct", _MOE + "experts.linear_fc2.weight*", "model.layers.*.block_sparse_moe.experts.*.w2.weight", {}),
    ),
    "Qwen2MoeForCausalLM": (
        ("direct", "embedding.word_embeddings.weight", "model.embed_tokens.weight", {}),
        ("direct", "output_layer.weight", "lm_head.weight", {}),
        ("direct", "decoder.final_layernorm.weight", "model.norm.weight", {}),
        ("direct", "decoder.layers.*.self_attention.linear_qkv.layer_norm_weight", "model.layers.*.input_layernorm.weight", {}),
        *(("qkv", f"decoder.layers.*.self_attention.linear_qkv.{kind}",
           {part: f"model.layers.*.self_attn.{part}_proj.{kind}" for part in "qkv"}, {}) for kind in ("weight", "bias")),
        ("direct", "decoder.layers.*.self_attention.linear_proj.weight", "model.layers.*.self_attn.o_proj.weight", {}),
        ("direct", "decoder.layers.*.pre_mlp_layernorm.weight", "model.layers.*.post_attention_layernorm.weight", {}),
        ("direct", _MOE + "router.weight", "model.layers.*.mlp.gate.weight", {}),
        ("gated_mlp", _MOE + "experts.linear_fc1.weight*",
         {"gate": "model.layers.*.mlp.experts.*.gate_proj.weight", "up": "model.layers.*.mlp.experts.*.up_proj.weight"}, {}),
        ("direct", _MOE + "experts.linear_fc2.weight*", "model.layers.*.mlp.experts.*.down_proj.weight", {}),
        ("gated_mlp", _MOE + "shared_experts.linear_fc1.weight",
         {"gate": "model.layers.*.mlp.shared_expert.gate_proj.weight", "up": "model.layers.*.mlp.shared_expert.up_proj.weight"},
         {}),
        ("direct", _MOE + "shared_experts.linear_fc2.weight", "model.layers.*.mlp.shared_expert.down_proj.weight", {}),
        ("direct", _MOE + "shared_experts.gate_weight", "model.layers.*.mlp.shared_expert_gate.weight", {}),
    ),
    # mbridge's Qwen2.5-VL vision tower, Megatron's (Megatron-Bridge keeps Hugging Face's, `visual.**`)
    "Qwen2_5_VLForConditionalGeneration": (
        ("direct", "vision_model.patch_embed.proj.weight", "visual.patch_embed.proj.weight", {}),
        *(("direct", f"vision_model.decoder.layers.*.{megatron}", f"visual.blocks.*.{hf}", {}) for megatron, hf in (
            ("self_attention.linear_qkv.layer_norm_weight", "norm1.weight"),
            ("self_attention.linear_proj.weight", "attn.proj.weight"),
            ("self_attention.linear_proj.bias", "attn.proj.bias"),
            ("mlp.linear_fc1.layer_norm_weight", "norm2.weight"),
            ("mlp.linear_fc2.weight", "mlp.down_proj.weight"),
            ("mlp.linear_fc2.bias", "mlp.down_proj.bias"),
        )),
        *(("concatenated_qkv", f"vision_model.decoder.layers.*.self_attention.linear_qkv.{kind}",
           f"visual.blocks.*.attn.qkv.{kind}", {}) for kind in ("weight", "bias")),
        *(("gated_mlp", f"vision_model.decoder.layers.*.mlp.linear_fc1.{kind}",
           {"gate": f"visual.blocks.*.mlp.gate_proj.{kind}", "up": f"visual.blocks.*.mlp.up_proj.{kind}"}, {})
          for kind in ("weight", "bias")),
        ("direct", "vision_model.decoder.final_layernorm.weight", "visual.merger.ln_q.weight", {}),
        *(("direct", f"vision_model.projection.encoder.linear_fc{fc}.{kind}", f"visual.merger.mlp.{index}.{kind}", {})
          for fc, index in ((1, 0), (2, 2)) for kind in ("weight", "bias")),
    ),
}
# A critic's or reward model's head: Megatron's output layer of one row (a value) or of the labels'
# rows, with its bias where it has one (a token classifier's `score` has one, a sequence
# classifier's none); zeros where it has none (verl's value head), as the model computes without.
_SCORE: tuple[Row, ...] = (
    ("direct", "output_layer.weight", "score.weight", {}),
    ("direct", "output_layer.bias", "score.bias", {}),
    ("zeros", "output_layer.weight", "score.bias", {}),
)
_HEAD_CLASSES = re.compile(r"^(?P<base>\w+)For(TokenClassification|SequenceClassification)$")


@functools.cache
def bridge_tables() -> dict:
    """`megatron_bridge_tables.json`: `architectures` (each's table name), `tables`, `unbuilt`
    and the `megatron_bridge` version they were generated from."""
    with open(BRIDGE_TABLES) as handle:
        return json.load(handle)


def architectures() -> list[str]:
    """Every Hugging Face architecture whose Megatron-Core checkpoints rayexport maps."""
    return sorted(set(bridge_tables()["architectures"]) | set(MBRIDGE_TABLES))


def table(config: dict) -> tuple[Row, ...]:
    """The rows of the model whose config.json is `config`, Megatron-Bridge's first, or one line
    naming its architecture as not mapped. A critic's or reward model's class
    (`XForTokenClassification`, `XForSequenceClassification`) takes its causal LM's rows and its
    `score` head."""
    architecture = (config.get("architectures") or [None])[0]
    head = _HEAD_CLASSES.match(architecture or "")
    base = f"{head['base']}ForCausalLM" if head else architecture
    tables = bridge_tables()
    name = tables["architectures"].get(base)
    rows = tuple(tuple(row) for row in tables["tables"][name]) if name else ()
    rows += MBRIDGE_TABLES.get(base, ())
    if not rows:
        raise ExportError(
            f"Megatron-Core checkpoints of architecture '{architecture}' (model type '{config.get('model_type')}') "
            f"are not mapped to Hugging Face names (rayexport maps {len(architectures())} architectures, "
            f"docs/layouts.md lists them); check --hf-config"
        )
    return (_SCORE if head else ()) + rows
