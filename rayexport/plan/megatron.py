"""Megatron-Core's names for a Hugging Face model, and the tiles of them that each on-disk tensor
is: what each tensor of a `torch_dist` checkpoint becomes. Pure functions.

Which Megatron-Core parameter each Hugging Face tensor comes from, and how, is data: the tables
of `rayexport.plan.megatron_tables`, Megatron-Bridge's own mapping registries. What this module
adds is where Megatron-Core's `torch_dist` save puts each parameter (`saved_keys`):
- a save holds each parameter as its global tensor, whatever the tensor parallelism: stacked on a
  leading layer axis for a block of like layers (`decoder.layers.X` is (layers, ...)), each layer
  apart where they differ (`decoder.layers.<L>.X`), MoE experts on a second axis
  (`decoder.layers.mlp.experts.experts.linear_fc1.weight` is (layers, experts, 2 * ffn, hidden));
  pipeline stages, virtual ones included, save their layers' range of the same tensor;
- a norm is saved under TransformerEngine's fused name or the local spec's;
and the model's multi-token-prediction layers, which transformers' classes have no place for
and Hugging Face checkpoints carry (`ProducerNaming.beyond_model`). How each tensor is cut from
its saved tensor is `rayexport.plan.megatron_cuts`.

The rules are applied here rather than by calling Megatron-Bridge: that imports Megatron-Core,
which needs a torch of its own and builds the whole model. tests/test_megatron_bridge.py checks
them tensor for tensor against Megatron-Bridge's export of its own saves, and tests/test_megatron.py
against mbridge's export of Megatron-Core 0.16's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable

from rayexport.common.errors import ExportError
from rayexport.plan.formats import Naming, ProducerNaming
from rayexport.plan.megatron_cuts import Cut, split_keys
from rayexport.plan.megatron_tables import Row, table
from rayexport.plan.tiles import Tile

PRODUCER = "megatron"
Saved = dict[str, tuple[tuple[int, ...], str]]  # each saved tensor's global shape and dtype

# Names only Megatron-Core gives, to recognise its checkpoints by.
_SIGNATURES = re.compile(
    r"^(language_model\.|vision_model\.)?"
    r"(embedding\.word_embeddings\.weight|output_layer\.weight|decoder\.(layers|final_layernorm)\..*|mtp\.layers\..*)$"
)
# A norm's two names: fused into the linear layer that follows it, as TransformerEngine's layer
# spec has it, or a module apart, as the local spec (and TE's MoE layers) has it. Megatron-Core's
# local spec saves dense layers under the fused names (its `sharded_state_dict_keys_map`), which
# is why a save can hold either.
_NORM_SPELLINGS = (
    ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    ("self_attention.linear_qkv.layer_norm_bias", "input_layernorm.bias"),
    ("self_attention.linear_q_up_proj.layer_norm_weight", "self_attention.q_layernorm.weight"),
    ("self_attention.linear_kv_up_proj.layer_norm_weight", "self_attention.kv_layernorm.weight"),
    ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
    ("mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias"),
)
# Where a config counts its multi-token-prediction layers (DeepSeek-V3's and GLM's; Qwen3-Next's and Qwen3.5's).
_MTP_COUNTS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")
_MTP_TOKEN = re.compile(r"(\{layers\+mtp\}|\{mtp\})")
_WILDCARDS = re.compile(r"\{layers\+mtp\}|\{mtp\}|\*\*|\*")
# The first number of a parameter name, its layer's in a list of like modules that Megatron-Core
# saves stacked (`decoder.layers.3.X`, `mtp.layers.0.X`, `deepstack_merger_list.0.X`), and an
# expert's number: TEGroupedMLP's `experts.linear_fc1.weight3` or SequentialMLP's
# `experts.local_experts.3.linear_fc1.weight` (`*`: every expert, in a fused tensor).
_LAYER = re.compile(r"^(?P<head>.*?\.)(?P<index>\d+)\.(?P<rest>.+)$")
_EXPERT = re.compile(
    r"^(?P<head>.*\.experts\.)(local_experts\.(?P<local>\d+|\*)\.(?P<fc>linear_fc\d)\.(?P<kind>weight|bias)"
    r"|(?P<grouped_fc>linear_fc\d)\.(?P<grouped_kind>weight|bias)(?P<grouped>\d*|\*))$"
)


def megatron_names(names: Iterable[str]) -> list[str]:
    """The names among `names` that only Megatron-Core gives (empty: not a Megatron checkpoint)."""
    return [name for name in names if _SIGNATURES.match(name)]


def megatron_namings(saved: Saved) -> Callable[[dict, Naming], dict[str, ProducerNaming]]:
    """The `Checkpoint.producer_namings` of a checkpoint whose tensors are `saved`: Megatron's
    naming of the model whose config.json and on-disk naming it is given."""
    def namings(config: dict, disk: Naming) -> dict[str, ProducerNaming]:
        return {PRODUCER: megatron_naming(config, disk, saved)}

    return namings


def megatron_naming(config: dict, disk: Naming, saved: Saved) -> ProducerNaming:
    """Megatron's naming of the model whose config.json is `config` and on-disk naming `disk`,
    each on-disk tensor as its box of the `saved` tensor it is cut from, or one line naming the
    architecture, tensor or size that does not fit."""
    rows = _compiled(table(config))
    expected: Saved = {}
    tiles: dict[str, tuple[Tile, ...]] = {}
    found = {name: _source_of(name, rows, saved, config) for name in disk.expected}
    for name, source in found.items():
        if source is None:
            if name in disk.aliases:
                continue  # a tied alias the checkpoint does not hold
            raise ExportError(_unsaved(name, rows, saved, config))
        expected.update({key: saved[key] for key in source.keys})
        tiles[name] = source.tiles(name, disk.expected, saved, config)
    aliases = {
        found[alias].key: found[canonical].key for alias, canonical in disk.aliases.items()
        if found.get(alias) is not None and found.get(canonical) is not None and found[alias].key != found[canonical].key
    }
    mtp = _mtp_tensors(config, disk, rows, saved)
    beyond = {name: (shape, saved[source.keys[0]][1]) for name, (shape, source) in mtp.items()}
    for name, (_, source) in mtp.items():
        expected.update({key: saved[key] for key in source.keys})
        tiles[name] = source.tiles(name, {**disk.expected, **beyond}, saved, config)
    return ProducerNaming(Naming(expected, aliases), tiles, beyond)


def _mtp_tensors(config: dict, disk: Naming, rows: list["_Compiled"], saved: Saved) -> dict[str, tuple[tuple, "_Source"]]:
    """The model's multi-token-prediction layers the checkpoint holds, which transformers' model
    class has no place for: each on-disk name, with its shape and saved tensor. Their names are
    the table's MTP rows at each MTP layer the config counts. An MTP layer is a decoder layer: a
    tensor the decoder's layers have too is named, and shaped, as the last decoder layer's of the
    same name (its experts' numbers included), and not at all where the model names it otherwise
    (a row of the other expert format); the layer's own (its norms and projection) take their
    shapes from the saved tensor."""
    text = _text(config)
    layers, count = text.get("num_hidden_layers", 0), next((text[f] for f in _MTP_COUNTS if text.get(f)), 0)
    mtp_rows = [row for row in rows if "{mtp}" in row.megatron]
    decoder_parts = [hf for row in rows if "{mtp}" not in row.megatron for _, hf, _ in row.parts]
    found: dict[str, tuple[tuple, _Source]] = {}
    for row in mtp_rows:
        for _, hf, _ in row.parts:
            head, token, rest = (_MTP_TOKEN.split(hf, maxsplit=1) + ["", ""])[:3]  # no token: the one MTP layer's name
            decoder = re.compile(rf"^(?:.*\.)?layers\.{layers - 1}(?P<rest>{_regex(rest).pattern[1:-1]})$")
            suffixes = {match["rest"]: disk.expected[name][0] for name in disk.expected if (match := decoder.match(name))}
            of_decoder = token and any(part.endswith("layers.*" + rest) for part in decoder_parts)
            if not suffixes and not of_decoder and not _WILDCARDS.search(rest):
                suffixes = {rest: None}
            for layer in range(count if token else min(count, 1)):
                number = "" if not token else layers + layer if token == "{layers+mtp}" else layer
                for suffix, shape in suffixes.items():
                    name = f"{head}{number}{suffix}"
                    if name in disk.expected or name in found:
                        continue
                    source = _source_of(name, mtp_rows, saved, config)
                    if source is not None:
                        found[name] = (shape or saved[source.keys[0]][0][len(source.index):], source)
    return found


@dataclass(frozen=True)
class _Compiled:
    """A table row ready to match Hugging Face names: each part's pattern as a regex."""

    kind: str
    megatron: str
    parts: tuple[tuple[str, str, re.Pattern], ...]  # (part, Hugging Face pattern, its regex)
    options: dict


def _compiled(rows: tuple[Row, ...]) -> list[_Compiled]:
    compiled = []
    for kind, megatron, hf, *options in rows:
        parts = hf.items() if isinstance(hf, dict) else (("", hf),)
        compiled.append(_Compiled(kind, megatron, tuple((part, pattern, _regex(pattern)) for part, pattern in parts),
                                  options[0] if options else {}))
    return compiled


def _regex(pattern: str) -> re.Pattern:
    """A table pattern as a regex whose groups are its wildcards, in order: `*` a number, `**` a
    name; the MTP layer's number is group `mtp`, where Hugging Face numbers it after the decoder's
    layers (`{layers+mtp}`) or from 0 (`{mtp}`)."""
    escaped = re.escape(pattern).replace(r"\*\*", "(.+)").replace(r"\*", r"(\d+)")
    escaped = escaped.replace(r"\{layers\+mtp\}", r"(?P<mtp>\d+)").replace(r"\{mtp\}", r"(?P<mtp>\d+)")
    return re.compile("^" + escaped + "$")


@dataclass(frozen=True)
class _Source:
    """Where an on-disk tensor comes from: table row `row`'s part `part`, at the saved tensor
    `key`, whose leading axes are indexed at `index` (its layer, its expert), with the wildcard
    values `captures` that named it."""

    row: _Compiled
    part: str
    key: str
    index: tuple[int, ...]
    captures: tuple[str, ...]

    @property
    def keys(self) -> list[str]:
        """The saved tensors it is read from: `key`, or the pieces Megatron-Core saves it split into."""
        return split_keys(self.row.kind, self.part, self.key)

    def tiles(self, name: str, shapes: dict, saved: Saved, config: dict) -> tuple[Tile, ...]:
        """The tiles of the saved tensor that on-disk tensor `name` (of `shapes[name]`) is."""
        parts = {part: tuple(shapes[sibling][0]) for part, sibling in self.siblings().items() if sibling in shapes}
        tower = config["vision_config"] if self.key.startswith("vision_model.") and config.get("vision_config") else _text(config)
        pieces = tuple((key, tuple(saved[key][0])) for key in self.keys)
        cut = Cut(self.row.kind, self.row.options, self.part, self.key, pieces[0][1], self.index, tower,
                  pieces if self.keys != [self.key] else ())
        return cut.tiles(name, tuple(shapes[name][0]), parts)

    def siblings(self) -> dict[str, str]:
        """The on-disk names of every part of the row at the same wildcard values."""
        return {part: _fill(pattern, self.captures) for part, pattern, _ in self.row.parts}


def _fill(pattern: str, captures: tuple[str, ...]) -> str:
    """`pattern` with its wildcards replaced by `captures`, in order."""
    values = iter(captures)
    return _WILDCARDS.sub(lambda _: next(values), pattern)


def _source_of(name: str, rows: list[_Compiled], saved: Saved, config: dict) -> _Source | None:
    """The first table row whose pattern names `name` and whose parameter the checkpoint holds,
    where it holds it; None if none does."""
    for row in rows:
        for part, hf, regex in row.parts:
            found = regex.match(name)
            if found is None:
                continue
            parameter = _parameter(row.megatron, hf, found, config)
            if parameter is None:
                continue
            for key, index in saved_keys(parameter):
                if all(held in saved and len(saved[held][0]) >= len(index) for held in split_keys(row.kind, part, key)):
                    return _Source(row, part, key, index, found.groups())
    return None


def _parameter(megatron: str, hf: str, found: re.Match, config: dict) -> str | None:
    """The Megatron-Core parameter name of table pattern `megatron` at the wildcard values that
    the Hugging Face name matched (`found`, by `hf`); a wildcard left over (a fused tensor's
    experts) stays `*`. An MTP layer is numbered from 0, also where Hugging Face numbers it after
    the decoder's layers (`{layers+mtp}`) or has one MTP layer it gives no number; None where
    its number is not past the decoder's layers."""
    captures = list(found.groups())
    layer = 0
    if "mtp" in found.re.groupindex:
        layer = int(captures.pop(found.re.groupindex["mtp"] - 1))
        if "{layers+mtp}" in hf:
            layer -= _text(config)["num_hidden_layers"]
        if layer < 0:
            return None
    values = iter(captures)
    return re.sub(r"\*\*|\*", lambda wildcard: next(values, wildcard.group()), megatron.replace("{mtp}", str(layer)))


def saved_keys(parameter: str) -> list[tuple[str, tuple[int, ...]]]:
    """Where Megatron-Core's torch_dist save can put `parameter`, each a key and the index on its
    leading axes: an MoE expert's tensor on the experts' axis of its layer's
    (`...mlp.experts.experts.linear_fc1.weight`); a layer's on the layer axis of a stack of like
    layers (or of other modules of a list), or apart under its own number; a norm under either spec's name for it
    (`_NORM_SPELLINGS`). A parameter naming no expert (`weight*`: a fused tensor of them all)
    indexes none."""
    keys = []
    for spelling in _spellings(parameter):
        keys.extend(key for key in _placed(spelling) if key not in keys)
    return keys


def _spellings(parameter: str) -> list[str]:
    """`parameter`, and the same tensor under the other names a save gives it: a norm under the
    other layer spec's name; an MTP layer's transformer layer as `transformer_layer`, as
    Megatron-Core's `MultiTokenPredictionLayer.sharded_state_dict` saves its `mtp_model_layer`."""
    spellings = [parameter]
    for fused, apart in _NORM_SPELLINGS:
        for this, other in ((fused, apart), (apart, fused)):
            if parameter.endswith("." + this):
                spellings.append(parameter[: -len(this)] + other)
    return spellings + [name.replace(".mtp_model_layer.", ".transformer_layer.") for name in spellings if ".mtp_model_layer." in name]


def _placed(parameter: str) -> list[tuple[str, tuple[int, ...]]]:
    """`saved_keys` of one spelling of a parameter."""
    experts: tuple[int, ...] = ()
    expert = _EXPERT.match(parameter)
    if expert is not None:
        number = expert["local"] or expert["grouped"]
        fc, kind = expert["fc"] or expert["grouped_fc"], expert["kind"] or expert["grouped_kind"]
        parameter = f"{expert['head']}experts.{fc}.{kind}"
        experts = (int(number),) if number not in (None, "", "*") else ()
    layer = _LAYER.match(parameter)
    if layer is None:
        return [(parameter, experts)]
    stacked = layer["head"] + layer["rest"]
    return [(stacked, (int(layer["index"]), *experts)), (parameter, experts)]


def _unsaved(name: str, rows: list[_Compiled], saved: Saved, config: dict) -> str:
    """Why on-disk tensor `name` has no saved tensor: no row names it, or the one that does names
    a parameter the checkpoint lacks."""
    for row in rows:
        for _, hf, regex in row.parts:
            found = regex.match(name)
            if found is not None and (parameter := _parameter(row.megatron, hf, found, config)) is not None:
                key = saved_keys(parameter)[0][0]
                return f"the Megatron-Core checkpoint has no tensor '{key}', which '{name}' is cut from"
    return f"tensor '{name}' of the config's model has no Megatron-Core name in rayexport's tables"


def _text(config: dict) -> dict:
    return config.get("text_config") or config
