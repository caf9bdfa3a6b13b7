"""Each kind of Megatron-Bridge mapping as tiles: how a Hugging Face tensor is cut from the
global tensor a Megatron-Core `torch_dist` checkpoint saves for a parameter. Pure functions.

A save holds each parameter's global tensor, whatever the tensor parallelism it was trained
with, at an index on its leading axes (a layer's in a stack of like layers, an expert's):
- `direct`: the tensor itself, its dims permuted where the row says so; the vocabulary's rows
  only (Megatron may pad it);
- `qkv`: `linear_qkv` rows come a query group at a time, [the group's q rows ; its k rows ; its
  v rows] (Megatron-Bridge's QKVMapping);
- `concatenated_qkv`: the same rows gathered into one Hugging Face tensor, [all q ; all k ; all v]
  (vision towers' fused `qkv`);
- `gated_mlp`: `linear_fc1` is [gate ; up] in the saved tensor (each tensor-parallel rank saves
  its two halves as two chunks), so each half is a block of rows;
- `fused_experts`, `fused_gated_experts`: every expert of a layer as one Hugging Face tensor,
  (experts, out, in) as saved, or transposed where only that fits.
A kind not listed here (a mapping whose transform rayexport does not apply yet) is refused by name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from rayexport.common.errors import ExportError
from rayexport.plan.tiles import Tile, permute

_VOCAB = re.compile(r"(^|\.)(embedding\.word_embeddings|output_layer)\.weight$")


# The kinds whose parameter Megatron-Core saves split into pieces of its own, `<key>.<piece>`
# (its `_split_tensor_factory`: GatedDeltaNet's and MambaMixer's input projections and
# convolutions), each a global tensor; by kind, each Hugging Face part's pieces, in the order its
# rows take them. `gdn_in_proj` (Qwen3-Next) takes them a key head at a time, the others whole.
SPLITS = {
    "gdn_in_proj": {"qkvz": ("query", "key", "value", "z"), "ba": ("beta", "alpha")},
    "gdn_in_proj_separate": {"qkv": ("query", "key", "value"), "z": ("z",), "b": ("beta",), "a": ("alpha",)},
    "gdn_conv1d": {"": ("query", "key", "value")},
    "mamba_in_proj": {"": ("z", "x", "B", "C", "dt")},
    "mamba_conv1d": {"": ("x", "B", "C")},
}


def split_keys(kind: str, part: str, key: str) -> list[str]:
    """The saved tensors a Hugging Face part of a row of `kind` is read from, for parameter
    `key`: the key itself, or the pieces Megatron-Core saves it split into."""
    return [f"{key}.{piece}" for piece in SPLITS[kind][part]] if kind in SPLITS else [key]


@dataclass(frozen=True)
class Cut:
    """One Hugging Face tensor's source: table row kind `kind` (with its `options`), its part
    `part` (q, k, v; gate, up; "" for a row of one tensor), from saved tensor `key` of shape
    `key_shape` at `index` on its leading axes (a split parameter's pieces: `pieces`, their
    shapes by key); `tower`, the config section of the model part it belongs to (a VLM's vision
    tower, or its language model)."""

    kind: str
    options: dict
    part: str
    key: str
    key_shape: tuple[int, ...]
    index: tuple[int, ...]
    tower: dict
    pieces: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def tiles(self, name: str, shape: tuple[int, ...], parts: dict[str, tuple[int, ...]]) -> tuple[Tile, ...]:
        """On-disk tensor `name` of `shape` as tiles of the saved tensor; `parts`: the shapes of
        the on-disk tensors of every part of the row at the same place (a q's k and v)."""
        for position, limit in zip(self.index, self.key_shape):
            if position >= limit:
                raise ExportError(
                    f"'{name}' needs layer {position} of Megatron-Core tensor '{self.key}', which holds {limit} "
                    f"(shape {list(self.key_shape)}); check --hf-config"
                )
        cut = _CUTS.get(self.kind)
        if cut is None:
            raise ExportError(
                f"'{name}' comes from Megatron-Core tensor '{self.key}' through Megatron-Bridge's {self.kind} "
                f"mapping, which rayexport does not apply yet"
            )
        return cut(self, name, tuple(shape), parts)

    @property
    def inner(self) -> tuple[int, ...]:
        """The saved tensor's shape past its index."""
        return self.key_shape[len(self.index):]

    def misfit(self, name: str, shape: tuple[int, ...], what: str) -> ExportError:
        return ExportError(
            f"Megatron-Core tensor '{self.key}' has shape {list(self.key_shape)}, not {what} for '{name}' of shape "
            f"{list(shape)}; check --hf-config"
        )

    def boxes(self, shape: tuple[int, ...], blocks: list[tuple[int, int, int]]) -> tuple[Tile, ...]:
        """The tiles of a target of `shape` that take, for each (target row, source row, rows) of
        `blocks`, those rows of the saved tensor at the index (a 0-D target: its one element)."""
        lead = len(self.index)
        if not shape:
            return (Tile(self.key, (), (), self.index, ()),)
        rest = (0,) * (len(shape) - 1)
        axes = tuple(range(lead, lead + len(shape)))
        return tuple(
            Tile(self.key, (target_row, *rest), (rows, *shape[1:]), (*self.index, source_row, *rest), axes)
            for target_row, source_row, rows in blocks
        )


def _direct(cut: Cut, name: str, shape: tuple, parts: dict) -> tuple[Tile, ...]:
    """The saved tensor itself: its dims permuted as the row's `permute_dims` says, unit axes
    added or dropped ([N] saved as [1, N]), and for the vocabulary (embedding, output layer) the
    rows past it dropped (Megatron may pad it)."""
    inner = cut.inner
    whole = [(0, 0, inner[0])] if inner else []
    order = tuple(cut.options.get("permute_dims") or ())
    if order and tuple(inner[axis] for axis in order) == shape:
        return permute(cut.boxes(inner, whole), order)
    if inner == shape:
        return cut.boxes(shape, whole)
    if _VOCAB.search(cut.key) and inner and shape and inner[1:] == shape[1:] and inner[0] >= shape[0]:
        return cut.boxes(shape, [(0, 0, shape[0])])
    if tuple(size for size in inner if size != 1) == tuple(size for size in shape if size != 1):
        kept = iter(axis for axis, size in enumerate(inner) if size != 1)
        axes = tuple(len(cut.index) + next(kept) if size != 1 else None for size in shape)
        return (Tile(cut.key, (0,) * len(shape), shape, (*cut.index, *(0,) * len(inner)), axes),)
    raise cut.misfit(name, shape, "the same tensor")


def _qkv(cut: Cut, name: str, shape: tuple, parts: dict) -> tuple[Tile, ...]:
    """q, k or v of `linear_qkv` (weight or bias): its rows come a query group at a time,
    [the group's q rows ; its k rows ; its v rows]; the size of each comes from the on-disk
    tensors' shapes (a part a layer lacks, none) and the config's query groups."""
    groups = cut.tower.get("num_key_value_heads") or cut.tower.get("num_attention_heads") or 1
    sizes = {part: parts[part][0] if part in parts else 0 for part in "qkv"}
    block = sum(sizes.values()) // groups
    if any(size % groups for size in sizes.values()) or cut.inner[:1] != (groups * block,) or cut.inner[1:] != shape[1:]:
        raise cut.misfit(
            name, shape,
            f"{groups} query groups of {sizes['q'] // groups} q, {sizes['k'] // groups} k and {sizes['v'] // groups} v rows "
            f"(the config's query groups, the on-disk tensors' sizes)",
        )
    heads = cut.tower.get("num_attention_heads") or groups
    head_dim = cut.tower.get("head_dim") or cut.tower.get("hidden_size", 0) // heads
    if cut.part == "q" and sizes["q"] == 2 * heads * head_dim:
        # an attention output gate (Qwen3-Next, Qwen3.5): Hugging Face's q_proj holds each head's
        # q rows then its gate rows; a saved group, its heads' q rows, then their gate rows
        per_group = heads // groups
        return cut.boxes(shape, sorted(
            (2 * head * head_dim + gate * head_dim,
             head // per_group * block + gate * per_group * head_dim + head % per_group * head_dim, head_dim)
            for head in range(heads) for gate in (0, 1)
        ))
    start = {"q": 0, "k": sizes["q"] // groups, "v": (sizes["q"] + sizes["k"]) // groups}[cut.part]
    length = sizes[cut.part] // groups
    return cut.boxes(shape, [(group * length, group * block + start, length) for group in range(groups)])


def _concatenated_qkv(cut: Cut, name: str, shape: tuple, parts: dict) -> tuple[Tile, ...]:
    """A fused `qkv` (weight or bias), every q row, then every k row, then every v row, from
    `linear_qkv`, whose rows come a query group at a time, [q heads ; k head ; v head]."""
    heads = cut.tower.get("num_heads") or cut.tower.get("num_attention_heads") or 0
    groups = cut.tower.get("num_key_value_heads") or heads
    head_dim, extra = divmod(shape[0], heads + 2 * groups) if heads else (0, 1)
    if extra or heads % groups or cut.inner != shape:
        raise cut.misfit(name, shape, f"{heads} heads of q, k and v rows (the config's sizes)")
    q_rows = heads // groups * head_dim  # a group's
    block = q_rows + 2 * head_dim
    blocks = []
    for group in range(groups):
        blocks.append((group * q_rows, group * block, q_rows))
        blocks.append((heads * head_dim + group * head_dim, group * block + q_rows, head_dim))
        blocks.append(((heads + groups) * head_dim + group * head_dim, group * block + q_rows + head_dim, head_dim))
    return cut.boxes(shape, sorted(blocks))


def _zero_centred(cut: Cut, name: str, shape: tuple, parts: dict) -> tuple[Tile, ...]:
    """A norm Megatron-Core holds zero-centred, less the 1 Hugging Face's holds: added back."""
    return tuple(replace(tile, shift=1.0) for tile in _direct(cut, name, shape, parts))


def _zeros(cut: Cut, name: str, shape: tuple, parts: dict) -> tuple[Tile, ...]:
    """Zeros the model holds where Megatron has no tensor (a value head without a bias: the
    token classifier's `score.bias`), as 0 x the first elements of the row's parameter: a box of
    `shape` from its first row (the value head's rows), one element of every other axis."""
    inner = cut.inner
    if len(shape) != 1 or not inner or inner[0] != shape[0]:
        raise cut.misfit(name, shape, f"{shape[0] if shape else 0} rows to stand zeros in for")
    tile = Tile(cut.key, (0,), shape, (*cut.index, *(0,) * len(inner)), (len(cut.index),), scale=0.0)
    return (tile,)


def _pieces(cut: Cut, name: str, shape: tuple, parts: dict) -> tuple[Tile, ...]:
    """A Hugging Face tensor whose rows are a split parameter's pieces (`SPLITS`) one after the
    other; for Qwen3-Next's input projections, the rows of each key head's group of each piece in
    turn ([q ; k ; v ; z] of head 0, then of head 1, ...)."""
    groups = cut.tower.get("linear_num_key_heads", 1) if cut.kind == "gdn_in_proj" else 1
    inner = {key: piece_shape[len(cut.index):] for key, piece_shape in cut.pieces}
    if not shape or sum(rows[0] for rows in inner.values()) != shape[0] or any(
        rows[0] % groups or rows[1:] != shape[1:] for rows in inner.values()
    ):
        raise ExportError(
            f"Megatron-Core tensors {', '.join(f'{key!r} {list(piece_shape)}' for key, piece_shape in cut.pieces)} "
            f"are not {groups} group(s) of rows of '{name}' of shape {list(shape)}; check --hf-config"
        )
    tiles, target = [], 0
    for group in range(groups):
        for key, rows in inner.items():
            length = rows[0] // groups
            tiles.extend(replace(cut, key=key).boxes(shape, [(target, group * length, length)]))
            target += length
    return tuple(tiles)


def _gated_mlp(cut: Cut, name: str, shape: tuple, parts: dict) -> tuple[Tile, ...]:
    """The gate or the up half of `linear_fc1` (weight or bias), saved [gate ; up]."""
    if not shape or cut.inner != (2 * shape[0], *shape[1:]):
        raise cut.misfit(name, shape, f"a {cut.part} half")
    return cut.boxes(shape, [(0, 0 if cut.part == "gate" else shape[0], shape[0])])


def _fused_experts(cut: Cut, name: str, shape: tuple, parts: dict) -> tuple[Tile, ...]:
    """Every expert of a layer as one tensor, (experts, out, in) as saved (a gated one's rows
    [gate ; up]), or, where the row says `transpose_on_export` and only that fits the on-disk
    shape, (experts, in, out): Megatron-Bridge transposes just then."""
    order = tuple(range(len(shape)))
    if cut.inner != shape and cut.options.get("transpose_on_export") and len(shape) > 2:
        order = (*order[:-2], order[-1], order[-2])
    stored = tuple(shape[axis] for axis in order)
    if cut.inner != stored:
        raise cut.misfit(name, shape, "every expert of the layer")
    return permute(cut.boxes(stored, [(0, 0, stored[0])]), order)


def _gpt_oss_gate_up(cut: Cut, name: str, shape: tuple, parts: dict) -> tuple[Tile, ...]:
    """gpt-oss's experts' `gate_up_proj` (experts, hidden, 2 * ffn) or its bias (experts, 2 * ffn):
    the gate and up columns interleaved, gate first, where `linear_fc1` is (experts, [gate ; up],
    hidden) as saved."""
    inner, lead = cut.inner, len(cut.index)
    weight = len(shape) == 3
    rows = (shape[0], shape[2], shape[1]) if weight else shape
    if len(shape) not in (2, 3) or shape[-1] % 2 or inner != rows:
        raise cut.misfit(name, shape, "every expert's [gate ; up] rows")
    half = shape[-1] // 2
    axes = (lead, lead + 2, lead + 1) if weight else (lead, lead + 1)
    return tuple(
        Tile(cut.key, (0,) * (len(shape) - 1) + (part,), (*shape[:-1], half),
             (*cut.index, 0, part * half, *((0,) if weight else ())), axes, target_steps=(1,) * (len(shape) - 1) + (2,))
        for part in (0, 1)
    )


def _gpt_oss_down(cut: Cut, name: str, shape: tuple, parts: dict) -> tuple[Tile, ...]:
    """gpt-oss's experts' `down_proj` (experts, ffn, hidden), each expert's `linear_fc2`
    (hidden, ffn) transposed, whatever the sizes (gpt-oss's are square); its bias (experts,
    hidden) as saved."""
    if len(shape) != 3:
        return _direct(cut, name, shape, parts)
    stored = (shape[0], shape[2], shape[1])
    if cut.inner != stored:
        raise cut.misfit(name, shape, "every expert's linear_fc2, transposed")
    return permute(cut.boxes(stored, [(0, 0, stored[0])]), (0, 2, 1))


_CUTS = {
    "direct": _direct, "qkv": _qkv, "concatenated_qkv": _concatenated_qkv, "gated_mlp": _gated_mlp,
    "fused_experts": _fused_experts, "fused_gated_experts": _fused_experts, "zero_centered_norm": _zero_centred,
    "zeros": _zeros, "gpt_oss_gate_up": _gpt_oss_gate_up, "gpt_oss_down": _gpt_oss_down,
    **dict.fromkeys(SPLITS, _pieces),
}
