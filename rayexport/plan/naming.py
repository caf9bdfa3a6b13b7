"""Naming: which output tensor each source key becomes. Checkpoint keys are normalised and
matched to the config's model names, tied aliases resolved, PEFT names mapped to the base model
and LoRA adapters matched to their weights, and each output's dtype chosen. Pure functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Iterable

from rayexport.common.dtypes import SAFETENSORS_DTYPES, is_floating, nbytes
from rayexport.common.errors import ExportError
from rayexport.plan.formats import IN_MEMORY, ModelFormats, choose_naming, convert_plans
from rayexport.plan.keys import normalize_key
from rayexport.plan.lora import (
    LoraSettings, LoraTarget, adapter_tensor_name, is_peft_checkpoint, lora_settings, split_peft_names,
)
from rayexport.plan.megatron import megatron_names
from rayexport.plan.pieces import BASE_MODEL_RANK, Piece, tensor_pieces
from rayexport.plan.shards import ShardInfo
from rayexport.plan.ties import TieResolution, resolve_tied_names
from rayexport.plan.torchtitan import torchtitan_names


@dataclass(frozen=True)
class TensorPlan:
    """One output tensor: its name, shape, dtypes, the pieces it is assembled from and, for a
    LoRA-adapted weight in merge mode, the adapter folded into it."""

    name: str
    source_key: str
    shape: tuple[int, ...]
    source_dtype: str
    dtype: str
    pieces: tuple[Piece, ...]
    lora: "LoraMerge | None" = None

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype)

    @property
    def all_pieces(self) -> tuple[Piece, ...]:
        """Every piece this output needs gathered, adapter halves included."""
        if self.lora is None:
            return self.pieces
        return self.pieces + self.lora.a.pieces + self.lora.b.pieces


@dataclass(frozen=True)
class LoraMerge:
    """W + scale * B @ A, with A and B gathered alongside W; with `fan_in_fan_out`, W is stored
    (in, out) (transformers' Conv1D) and the delta is transposed."""

    a: TensorPlan
    b: TensorPlan
    scale: float
    fan_in_fan_out: bool = False


@dataclass(frozen=True)
class LoraRequest:
    """What to do with LoRA adapters: `mode` merge|adapter|both, settings from the checkpoint's
    `lora_train_meta.json` (`meta`) overridden by the user (`overrides`); `fan_in_fan_out`:
    the model's weights stored (in, out), by in-memory name (`lora.fan_in_fan_out_weights`)."""

    mode: str = "merge"
    meta: dict | None = None
    overrides: dict = field(default_factory=dict)
    fan_in_fan_out: frozenset[str] = frozenset()


@dataclass
class TensorPlanning:
    """Everything `plan_holdings` decides; `naming` is the naming the checkpoint was matched
    in, `format` the one the tensors are written in."""

    tensors: list[TensorPlan]
    adapters: list[TensorPlan]
    resolution: TieResolution
    tied_key_pairs: list[tuple[str, str]]
    lora: LoraSettings | None = None
    lora_targets: list[LoraTarget] = field(default_factory=list)
    naming: str = IN_MEMORY
    format: str = IN_MEMORY
    kept_float32: frozenset[str] = frozenset()  # written in float32 whatever `dtype`: see plan_holdings


def plan_holdings(
    holders: dict[str, dict[int, ShardInfo]],
    formats: ModelFormats,
    output_format: str,
    dtype: str | None,
    lora: LoraRequest | None = None,
    base_model: dict[str, ShardInfo] | None = None,
    untied: frozenset[str] = frozenset(),
    float32_names: frozenset[str] = frozenset(),
) -> TensorPlanning:
    """Match the checkpoint's keys to the model's names and plan how each output tensor is
    assembled.

    `holders` maps each source key to the (pseudo-)ranks holding part of it: every rank file of
    a verl checkpoint (`holders_from_ranks`), or the one worker that read a whole DCP tensor.
    `formats` gives the model's names, shapes and tie aliases in both namings; the checkpoint
    is matched in the naming its keys are in, and its tensors converted to `output_format`.
    Tied aliases in `untied` are kept as tensors of their own. PEFT names are mapped to the
    base model's, and LoRA adapters merged or planned as adapter tensors per `lora`.
    `base_model` describes the tensors of a base model folder, used for names the checkpoint
    lacks (LoRA-only checkpoints); the exporter reads those itself as `BASE_MODEL_RANK`.
    Floating tensors are written in `dtype` (None: each in its own), except that those of
    `float32_names` saved in float32 stay float32: the tensors the model's class loads in float32
    whatever the checkpoint's dtype (DeepSeek-V3's router), so that narrowing them would only lose
    the bits the reload then computes with.
    """
    lora = lora or LoraRequest()
    match = match_names(holders, formats, base_model, untied)
    expected = formats.naming(match.naming).expected
    plans = {}
    for name in match.wanted:
        shape = tuple(expected[name][0])
        if name in match.from_base:
            plans[name] = _plan_tensor(name, name, shape, {BASE_MODEL_RANK: base_model[name]}, dtype)
        else:
            key = match.checkpoint_key[match.resolution.sources[name]]
            plans[name] = _plan_tensor(name, key, shape, holders[key], dtype)
    settings, adapters, targets = None, [], match.targets
    if targets:
        settings = lora_settings(lora.meta, _columns(holders[match.source_key_of[targets[0].b_name]]), lora.overrides)
        adapters = _plan_lora(
            targets, settings, plans, holders, match.source_key_of, lora,
            lambda weight: formats.memory_name(match.naming, weight), dtype,
        )
    tied_key_pairs = [
        (match.checkpoint_key[canonical], match.checkpoint_key[alias]) for canonical, alias in match.resolution.to_compare
    ]
    tensors = convert_plans(
        [plans[name] for name in match.wanted], formats.tiles(match.naming, output_format),
        formats.naming(output_format), match.naming, output_format,
    )
    kept = frozenset(
        plan.name for plan in tensors if plan.name in float32_names and plan.source_dtype == "float32" != plan.dtype
    )
    tensors = [replace(plan, dtype="float32") if plan.name in kept else plan for plan in tensors]
    return TensorPlanning(
        tensors=tensors, adapters=adapters, resolution=match.resolution, tied_key_pairs=tied_key_pairs,
        lora=settings, lora_targets=targets, naming=match.naming, format=output_format, kept_float32=kept,
    )


@dataclass(frozen=True)
class NameMatch:
    """A checkpoint's keys matched to the model: the naming they are in, model name -> source
    key (`checkpoint_key`), normalised name -> source key, the LoRA targets, the tie
    resolution, the names to write (`wanted`) and those read from the base model."""

    naming: str
    checkpoint_key: dict[str, str]
    source_key_of: dict[str, str]
    targets: list[LoraTarget]
    resolution: TieResolution
    wanted: list[str]
    from_base: list[str]


def match_names(
    keys: Iterable[str], formats: ModelFormats, base_model: dict | None = None, untied: frozenset[str] = frozenset()
) -> NameMatch:
    """Match a checkpoint's source keys to the model's names (see `plan_holdings`), or one line
    naming the first tensor the model needs that no source holds, or that it does not have.
    Needs only the keys, so a layout that lists them up front is checked before any read."""
    checkpoint_key, source_key_of, targets = model_names(keys)
    naming_kind = choose_naming(checkpoint_key or base_model or {}, formats)
    naming = formats.naming(naming_kind)
    aliases = {alias: canonical for alias, canonical in naming.aliases.items() if alias not in untied}
    resolution = resolve_tied_names(checkpoint_key, aliases)
    wanted = [name for name in naming.expected if name not in aliases]
    from_base = [name for name in wanted if name not in resolution.sources and name in (base_model or {})]
    hint = "" if naming_kind in formats.producers else _naming_hint(checkpoint_key, base_model is not None, bool(targets))
    _check_coverage(wanted, naming.expected, resolution, checkpoint_key, from_base, hint)
    return NameMatch(naming_kind, checkpoint_key, source_key_of, targets, resolution, wanted, from_base)


def _check_coverage(
    wanted: list[str], expected: dict, resolution: TieResolution, checkpoint_key: dict[str, str], from_base: list[str],
    hint: str,
) -> None:
    """One line naming the first tensor the model needs that no source holds (with `hint`), or
    the first tensor the checkpoint holds that the model lacks."""
    missing = [name for name in wanted if name not in resolution.sources and name not in from_base]
    if missing:
        raise ExportError(
            f"the checkpoint has no tensor '{missing[0]}' that the config's model needs"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + hint
        )
    unexpected = [name for name in resolution.sources if name not in expected]
    if unexpected:
        raise ExportError(
            f"the checkpoint's tensor '{checkpoint_key[resolution.sources[unexpected[0]]]}' is not "
            f"in the config's model" + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
        )


def _naming_hint(checkpoint_key: dict[str, str], has_base_model: bool, has_adapters: bool) -> str:
    """What the checkpoint's names say about why the model's are missing: another trainer's
    naming, or adapters without their base weights."""
    for producer, names_of in (("torchtitan", torchtitan_names), ("megatron", megatron_names)):
        foreign = names_of(checkpoint_key)
        if foreign:
            return f"; these look like {producer} names ({', '.join(foreign[:2])}, ...): read them with --layout {producer}"
    if has_adapters and not has_base_model:
        return "; for a LoRA-only checkpoint pass --base-model"
    return ""


def _plan_tensor(name: str, key: str, shape: tuple[int, ...], infos: dict[int, ShardInfo], dtype: str | None) -> TensorPlan:
    """The output tensor `name`, assembled from the pieces of source key `key` that `infos` hold."""
    dtypes = {info.dtype for info in infos.values()}
    if len(dtypes) != 1:
        raise ExportError(f"tensor '{key}' has different dtypes across ranks: {sorted(dtypes)}")
    source_dtype = dtypes.pop()
    return TensorPlan(
        name=name, source_key=key, shape=shape, source_dtype=source_dtype,
        dtype=output_dtype(source_dtype, dtype), pieces=tensor_pieces(key, infos, shape),
    )


def _plan_lora(
    targets: list[LoraTarget], settings: LoraSettings, plans: dict[str, TensorPlan], holders: dict,
    source_key_of: dict[str, str], lora: LoraRequest, memory_name: Callable[[str], str], dtype: str | None,
) -> list[TensorPlan]:
    """Fold each target's adapter into its base weight's plan (merge, both), and return the
    adapter tensors to write (adapter, both); `memory_name` gives a weight's in-memory name."""
    adapters = []
    for target in targets:
        weight = f"{target.module}.weight"
        if weight not in plans:
            raise ExportError(f"LoRA module '{target.module}' has no base weight '{weight}'")
        if len(plans[weight].shape) != 2:
            raise ExportError(
                f"LoRA module '{target.module}' has a {len(plans[weight].shape)}-D weight; only LoRA on "
                f"Linear and Conv1D layers is merged exactly"
            )
        fan_in_fan_out = memory_name(weight) in lora.fan_in_fan_out
        out_features, in_features = plans[weight].shape[::-1] if fan_in_fan_out else plans[weight].shape
        halves = []
        for which, normalized, shape in (("A", target.a_name, (settings.r, in_features)),
                                         ("B", target.b_name, (out_features, settings.r))):
            key = source_key_of[normalized]
            halves.append(_plan_tensor(adapter_tensor_name(target, which), key, shape, holders[key], dtype))
        if lora.mode in ("merge", "both"):
            plans[weight] = replace(plans[weight], lora=LoraMerge(halves[0], halves[1], settings.scale, fan_in_fan_out))
        if lora.mode in ("adapter", "both"):
            adapters.extend(halves)
    return adapters


def model_names(keys: Iterable[str]) -> tuple[dict[str, str], dict[str, str], list[LoraTarget]]:
    """What a checkpoint's source keys name: model name -> source key for the model's tensors
    (wrapper components such as `_orig_mod.` removed, and PEFT's prefixes in a PEFT checkpoint),
    normalised name -> source key for every key, and the LoRA targets (by normalised name)."""
    source_key_of: dict[str, str] = {}
    for key in keys:
        name = normalize_key(key)
        if name in source_key_of:
            raise ExportError(f"keys '{source_key_of[name]}' and '{key}' both name tensor '{name}'")
        source_key_of[name] = key
    if is_peft_checkpoint(source_key_of):
        names, targets = split_peft_names(source_key_of)
    else:
        names, targets = {name: name for name in source_key_of}, []
    return {name: source_key_of[normalized] for name, normalized in names.items()}, source_key_of, targets


def output_dtype(source_dtype: str, dtype: str | None) -> str:
    """The dtype a tensor is written in: `dtype` for floating tensors (None: their own);
    integers and bools are never cast."""
    if source_dtype not in SAFETENSORS_DTYPES:
        raise ExportError(f"dtype {source_dtype} cannot be written to safetensors")
    if dtype is None or not is_floating(source_dtype):
        return source_dtype
    return dtype


def choose_dtype(requested: str, config_dtype: str | None) -> tuple[str, str]:
    """The dtype floating tensors are written in, and why. `auto` is the dtype the model is
    published in: the config's, except that a float32 config (what trainers such as verl save,
    with float32 master weights) or none at all means bfloat16."""
    if requested != "auto":
        return requested, f"--dtype {requested}"
    if config_dtype not in (None, "float32"):
        return config_dtype, f"config.json's dtype {config_dtype}"
    said = "says float32" if config_dtype else "names no dtype (transformers reads float32)"
    return "bfloat16", (
        f"config.json {said}, the dtype training keeps master weights in, and models are published in "
        f"bfloat16; --dtype float32 keeps float32"
    )


def _columns(infos: dict[int, ShardInfo]) -> int:
    """The second dimension of a 2-D tensor spread over ranks (a LoRA B's rank r): FSDP shards
    rows, so every rank's part holds the columns whole, whether or not it is a DTensor (equal
    plain row shards of lora_A cannot tell a replica from a shard; lora_B's columns can)."""
    first = next(iter(infos.values()))
    return (first.global_shape or first.local_shape)[1]
