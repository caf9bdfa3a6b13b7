"""torchtitan's names for a Hugging Face model, and the tiles its `StateDictAdapter.to_hf`
makes of them: what each tensor of a torchtitan checkpoint becomes on disk. Pure functions.

The rules are written out here rather than by calling torchtitan's adapters: those need a
torchtitan model config, which a HF config does not give, and torchtitan installs only beside a
torch of its own. tests/test_torchtitan.py checks them tensor for tensor against `to_hf` on real
torchtitan 0.3.0 checkpoints.
"""

from __future__ import annotations

import re
from typing import Iterable

from rayexport.common.errors import ExportError
from rayexport.plan.formats import Naming, ProducerNaming
from rayexport.plan.tiles import Tile, whole

PRODUCER = "torchtitan"
# torchtitan's two generations of names: 0.3.0 fused q/k/v under `qkv_linear` and renamed the
# head and the MoE experts.
GENERATIONS = ("0.3", "0.2")

# (on-disk name, torchtitan 0.2.x name, torchtitan 0.3.0 name); {L} is a layer, {E} an expert.
_RULES = (
    ("model.embed_tokens.weight", "tok_embeddings.weight", "tok_embeddings.weight"),
    ("model.layers.{L}.self_attn.q_proj.weight", "layers.{L}.attention.wq.weight", "layers.{L}.attention.qkv_linear.wq.weight"),
    ("model.layers.{L}.self_attn.k_proj.weight", "layers.{L}.attention.wk.weight", "layers.{L}.attention.qkv_linear.wk.weight"),
    ("model.layers.{L}.self_attn.v_proj.weight", "layers.{L}.attention.wv.weight", "layers.{L}.attention.qkv_linear.wv.weight"),
    ("model.layers.{L}.self_attn.o_proj.weight", "layers.{L}.attention.wo.weight", "layers.{L}.attention.wo.weight"),
    ("model.layers.{L}.self_attn.q_norm.weight", "layers.{L}.attention.q_norm.weight", "layers.{L}.attention.q_norm.weight"),
    ("model.layers.{L}.self_attn.k_norm.weight", "layers.{L}.attention.k_norm.weight", "layers.{L}.attention.k_norm.weight"),
    ("model.layers.{L}.mlp.gate_proj.weight", "layers.{L}.feed_forward.w1.weight", "layers.{L}.feed_forward.w1.weight"),
    ("model.layers.{L}.mlp.up_proj.weight", "layers.{L}.feed_forward.w3.weight", "layers.{L}.feed_forward.w3.weight"),
    ("model.layers.{L}.mlp.down_proj.weight", "layers.{L}.feed_forward.w2.weight", "layers.{L}.feed_forward.w2.weight"),
    ("model.layers.{L}.input_layernorm.weight", "layers.{L}.attention_norm.weight", "layers.{L}.attention_norm.weight"),
    ("model.layers.{L}.post_attention_layernorm.weight", "layers.{L}.ffn_norm.weight", "layers.{L}.ffn_norm.weight"),
    ("model.layers.{L}.mlp.gate.weight", "layers.{L}.moe.router.gate.weight", "layers.{L}.moe.router.gate.weight"),
    # grouped experts [E, F, D] (w2: [E, D, F]); each expert's weight is its slice
    ("model.layers.{L}.mlp.experts.{E}.gate_proj.weight", "layers.{L}.moe.experts.w1", "layers.{L}.moe.routed_experts.inner_experts.w1_EFD"),
    ("model.layers.{L}.mlp.experts.{E}.up_proj.weight", "layers.{L}.moe.experts.w3", "layers.{L}.moe.routed_experts.inner_experts.w3_EFD"),
    ("model.layers.{L}.mlp.experts.{E}.down_proj.weight", "layers.{L}.moe.experts.w2", "layers.{L}.moe.routed_experts.inner_experts.w2_EDF"),
    ("model.norm.weight", "norm.weight", "norm.weight"),
    ("lm_head.weight", "output.weight", "lm_head.weight"),
)
_PATTERNS = tuple(
    (re.compile("^" + re.escape(rule[0]).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{E\}", r"(?P<E>\d+)") + "$"), rule)
    for rule in _RULES
)
# The HF model types torchtitan trains and converts, and whether its adapter reorders q and k
# rows (torchtitan's Llama RoPE rotates interleaved pairs, HF's rotates halves; Qwen3's do not).
MODEL_TYPES = {"llama": True, "qwen3": False, "qwen3_moe": False}
# Names only torchtitan gives, to recognise its checkpoints by.
_SIGNATURES = re.compile(
    r"^(tok_embeddings\.weight|output\.weight|layers\.\d+\.(attention\.(qkv_linear\.)?w[qkvo]\.weight|"
    r"feed_forward\.w[123]\.weight|attention_norm\.weight|ffn_norm\.weight|moe\..*))$"
)


def torchtitan_names(names: Iterable[str]) -> list[str]:
    """The names among `names` that only torchtitan gives (empty: not a torchtitan checkpoint)."""
    return [name for name in names if _SIGNATURES.match(name)]


def torchtitan_namings(config: dict, disk: Naming) -> dict[str, ProducerNaming]:
    """Each generation of torchtitan's names for the model whose on-disk naming is `disk` and
    whose config.json is `config`, with the tiles `to_hf` makes of them."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ExportError(
            f"torchtitan checkpoints of model type '{model_type}' are not mapped to Hugging Face names "
            f"(rayexport maps {', '.join(sorted(MODEL_TYPES))}); check --hf-config"
        )
    interleaved = _interleaved_rows(config) if MODEL_TYPES[model_type] else {}
    return {
        f"{PRODUCER} {generation}": _naming(disk, interleaved, column)
        for generation, column in zip(GENERATIONS, (2, 1))
    }


def _naming(disk: Naming, interleaved: dict[str, int], column: int) -> ProducerNaming:
    """torchtitan's names of one generation (`column` of `_RULES`) for every on-disk tensor."""
    expected, tiles = {}, {}
    for name, (shape, dtype) in disk.expected.items():
        source, expert = _source_of(name, column)
        if expert is None:
            expected[source] = (shape, dtype)
            heads = interleaved.get(name.rsplit(".", 2)[-2])
            tiles[name] = _interleave(source, shape, heads) if heads else (whole(source, shape),)
            continue
        grouped = expected.get(source, ((0, *shape), dtype))[0]
        expected[source] = ((max(grouped[0], expert + 1), *shape), dtype)
        tiles[name] = (Tile(source, (0,) * len(shape), shape, (expert, *(0,) * len(shape)), tuple(range(1, len(shape) + 1))),)
    aliases = {_source_of(alias, column)[0]: _source_of(canonical, column)[0] for alias, canonical in disk.aliases.items()}
    return ProducerNaming(Naming(expected, aliases), tiles)


def _source_of(name: str, column: int) -> tuple[str, int | None]:
    """The torchtitan name of on-disk tensor `name` and, for a grouped expert, its index."""
    for pattern, rule in _PATTERNS:
        found = pattern.match(name)
        if found:
            fields = found.groupdict()
            expert = fields.pop("E", None)
            return rule[column].format(**fields), None if expert is None else int(expert)
    raise ExportError(f"tensor '{name}' of the config's model has no torchtitan name rayexport knows")


def _interleaved_rows(config: dict) -> dict[str, int]:
    """The heads of the projections whose rows torchtitan's Llama keeps interleaved."""
    heads = config["num_attention_heads"]
    return {"q_proj": heads, "k_proj": config.get("num_key_value_heads") or heads}


def _interleave(source: str, shape: tuple[int, ...], heads: int) -> tuple[Tile, ...]:
    """`to_hf`'s reordering of q or k rows, per head h of size hd and half s in {0, 1}:
    on-disk row h*hd + s*hd/2 + j is torchtitan's row h*hd + 2*j + s."""
    rows, columns = shape
    head_dim = rows // heads
    half = head_dim // 2
    return tuple(
        Tile(source, (h * head_dim + s * half, 0), (half, columns), (h * head_dim + s, 0), (0, 1), (2, 1))
        for h in range(heads) for s in (0, 1)
    )
