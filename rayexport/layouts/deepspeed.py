"""DeepSpeed ZeRO checkpoints: what OpenRLHF, LLaMA-Factory and transformers' Trainer save with a
DeepSpeed config. `engine.save_checkpoint(dir, tag)` writes `dir/latest` (the tag), and in
`dir/<tag>/` a model states file (ZeRO-1/2: `mp_rank_00_model_states.pt`; ZeRO-3: one
`zero_pp_rank_R_mp_rank_00_model_states.pt` per rank) and an optimizer states file per rank
(`[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`), whose flat fp32 buffers hold the master
weights (`rayexport.plan.zero` says which run of which buffer each parameter is).

Nothing of DeepSpeed is imported and no file is `torch.load`ed: each file's record is read with a
few ranged requests and unpickled from an allow-list (`torch_zip`), DeepSpeed's few classes as
inert stand-ins; a worker reads only the fp32 buffers of its ranks (never the Adam moments
beside them), each parameter's run a 1-D view planned as a run of the flattened tensor.
Frozen parameters (a LoRA base), buffers and ties (`shared_params`) come from the model states.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rayexport.common.dtypes import itemsize
from rayexport.common.errors import ExportError
from rayexport.layouts.base import Advance, Checkpoint, Loaded, LoadStep, load_ranks, MappedTensors, SourceSettings, SourceTensors
from rayexport.layouts.mapped import map_range, mapped_ranges
from rayexport.layouts.torch_zip import StandIn, TensorRef, TorchZip
from rayexport.plan.schedule import assign_ranks
from rayexport.plan.shards import ShardInfo
from rayexport.plan.zero import frozen_runs, partitioned_runs, zero3_runs
from rayexport.storage.store import Store

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

LATEST = "latest"  # the tag of the newest checkpoint, which DeepSpeed writes last
ZERO3_MODEL_STATES = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
MODEL_STATES = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")  # ZeRO-1/2: rank 0's, the full 16-bit weights
OPTIM_STATES = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
# DeepSpeed's and Trainer's own files beside the tag folders, which an export does not carry
SAVE_FOLDER_FILES = frozenset({LATEST, "zero_to_fp32.py", "zero_to_torch.py", "trainer_state.json"})
TAG_FOLDER = re.compile(r"^global_step\d+$")
PIPELINE_STATES = re.compile(r"^layer_\d+-model_(\d+-)?model_states\.pt$|^layer_\d+-model_states\.pt$")
# The DeepSpeed classes its files pickle, built as stand-ins (`torch_zip.StandIn`).
STAND_INS = frozenset({
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
})
MODEL_STATES_RANK = -2  # the pseudo-rank of tensors read whole from rank 0's model states
_READ_BLOCK = 16 * 2**20  # a remote buffer is spooled in ranged reads of this size


@dataclass(frozen=True)
class Source:
    """A run of elements one (pseudo-)rank holds: parameter `name` (of `shape`)'s elements from
    `start` (None: all of it), the `length` elements of `tensor`'s storage from element `at`; the
    storage's bytes start at byte `byte_start` of `file`. Counted from the storage, not the tensor,
    since tensors can share one (ZeRO-1/2's 16-bit weights are views of one flat buffer)."""

    name: str
    shape: tuple[int, ...]
    file: str
    tensor: TensorRef
    byte_start: int
    at: int
    length: int
    start: int | None


@dataclass(frozen=True)
class DeepSpeedCheckpoint(Checkpoint):
    """One tag folder of a DeepSpeed save: what each rank's files hold for each parameter."""

    stage: int = 0
    sources: dict[int, tuple[Source, ...]] = field(default_factory=dict)  # by (pseudo-)rank

    def known_keys(self) -> list[str]:
        return sorted({source.name for sources in self.sources.values() for source in sources})

    def read_files(self) -> dict[str, int]:
        """The files the workers read, with their sizes."""
        names = {source.file for sources in self.sources.values() for source in sources}
        return {name: self.store.size(name) for name in sorted(names)}

    def share(
        self, num_workers: int, aliases: dict[str, str], load: LoadStep, file_readers: dict[str, int] | None = None
    ) -> Loaded:
        """Each rank's runs to one worker, ranks in contiguous blocks; what rank 0's model states
        hold whole, to worker 0. Where `file_readers` places the files, a rank goes where its
        optimizer file is."""
        ranks = sorted(rank for rank in self.sources if rank >= 0)
        worker_of_rank = assign_ranks(ranks, num_workers) if ranks else {}
        if file_readers is not None:
            worker_of_rank = {rank: file_readers[self.sources[rank][0].file] for rank in ranks}
        if MODEL_STATES_RANK in self.sources:
            worker_of_rank[MODEL_STATES_RANK] = 0 if file_readers is None else file_readers[self.sources[MODEL_STATES_RANK][0].file]
        return load_ranks(load, worker_of_rank)

    def part_bytes(self, part: list[int]) -> int:
        """The bytes of the buffers a worker reads for the ranks `part`."""
        return sum(_span_bytes(spans) for rank in part for spans in _spans(self.sources[rank]).values())

    def read(self, part: list[int], spool_dir: str, spooled: Advance) -> dict[int, SourceTensors]:
        """The runs of the ranks `part`, as views of their buffers (memory-mapped; a remote file's
        buffers spooled to local disk first, only those)."""
        return {rank: _read_rank(self.store, rank, self.sources[rank], spool_dir, spooled) for rank in part}


class RunTensors(MappedTensors):
    """One rank's runs of its parameters, views of its buffers mapped from the files `paths`."""

    def __init__(self, tensors: dict[str, torch.Tensor], sources: dict[str, Source], paths: list[str]) -> None:
        super().__init__(tensors, None)
        self.sources, self.paths = sources, paths

    def mapped_ranges(self) -> list[tuple[int, int]]:
        return [span for path in self.paths for span in mapped_ranges(path)]

    def describe(self, advance: Advance = lambda count: None) -> dict[str, ShardInfo]:
        infos = {}
        for key, tensor in self.tensors.items():
            dtype, source = str(tensor.dtype).removeprefix("torch."), self.sources[key]
            if source.start is None:
                infos[key] = ShardInfo(local_shape=tuple(tensor.shape), dtype=dtype)
            else:
                infos[key] = ShardInfo(local_shape=(tensor.numel(),), dtype=dtype, global_shape=source.shape,
                                       offset=(source.start,), flat=True)
            advance(tensor.nbytes)
        return infos


class DeepSpeedLayout:
    """DeepSpeed's ZeRO checkpoints (stages 1, 2 and 3), a save folder or one of its tag folders."""

    name = "deepspeed"

    def detect(self, store: Store, names: list[str]) -> bool:
        return LATEST in names or "zero_to_fp32.py" in names or any(
            ZERO3_MODEL_STATES.match(name) or MODEL_STATES.match(name) for name in names
        )

    def describe(self, store: Store, settings: SourceSettings) -> DeepSpeedCheckpoint:
        folder, beside = tag_folder(store, settings.tag)
        return read_checkpoint(folder, beside, settings.unsafe_pickle)

    def snapshot(self, store: Store, names: list[str]) -> dict[str, int] | None:
        if LATEST not in names:
            return None  # DeepSpeed writes `latest` once every rank has saved
        folder, _ = tag_folder(store, None)
        return {f"{folder.uri[len(store.uri):].strip('/')}/{name}": folder.size(name) for name in folder.list()}


def tag_folder(store: Store, tag: str | None) -> tuple[Store, Store]:
    """The tag folder `store` names (itself, its `--tag` child, or the one `latest` names), and
    the save folder beside which a trainer keeps config and tokenizer."""
    names = store.list()
    if any(ZERO3_MODEL_STATES.match(name) or MODEL_STATES.match(name) for name in names) and tag is None:
        return store, store.parent() or store
    named_by = "--tag"
    if tag is None:
        if LATEST not in names:
            tags = [name for name in store.folders() if TAG_FOLDER.match(name)]
            raise ExportError(
                f"no DeepSpeed checkpoint at '{store.uri}': no '{LATEST}' file naming its tag and no model states"
                + (f" (tag folders there: {', '.join(tags[-3:])}; pass --tag)" if tags else "")
            )
        tag, named_by = store.read_bytes(LATEST).decode(errors="replace").strip(), f"'{store.display(LATEST)}'"
    if not tag or "/" in tag or not store.child(tag).list():
        raise ExportError(f"{named_by} names tag '{tag[:60]}', but '{store.display(tag)}/' holds no files")
    return store.child(tag), store


def read_checkpoint(folder: Store, beside: Store, unsafe_pickle: bool = False) -> DeepSpeedCheckpoint:
    """Describe the tag folder `folder` from its files' records, or one line naming what is
    missing, unsupported or inconsistent."""
    names = folder.list()
    unsupported = next((name for name in names if PIPELINE_STATES.match(name)), None) or next(
        (name for name in names if (match := (ZERO3_MODEL_STATES.match(name) or MODEL_STATES.match(name)
                                              or OPTIM_STATES.match(name))) and int(match.groups()[-1]) > 0), None)
    if unsupported:
        raise ExportError(
            f"'{folder.display(unsupported)}' is a pipeline or tensor parallel DeepSpeed save, which rayexport does not read"
        )
    optim = _by_rank(names, OPTIM_STATES, 1)
    zero3 = _by_rank(names, ZERO3_MODEL_STATES, 0)
    model_file = "zero_pp_rank_0_mp_rank_00_model_states.pt" if zero3 else "mp_rank_00_model_states.pt"
    if model_file not in names:
        raise ExportError(f"no DeepSpeed model states in '{folder.uri}' (looked for '{model_file}')")
    model_zip = TorchZip(folder, model_file, STAND_INS, unsafe_pickle)
    model = model_zip.record
    world = _int_field(model, "dp_world_size", folder.display(model_file))
    for what, files in (("optimizer states", optim), ("model states", zero3)):
        missing = [rank for rank in range(world) if rank not in files]
        if files and missing:
            raise ExportError(f"'{folder.uri}' has no {what} file of rank {missing[0]} (of world size {world})")
    shapes = [{name: tuple(shape) for name, shape in group.items()} for group in model.get("param_shapes") or []]
    if not shapes:
        raise ExportError(f"'{folder.display(model_file)}' records no param_shapes: not a DeepSpeed model states file")
    frozen = {name: tuple(shape) for name, shape in (model.get("frozen_param_shapes") or {}).items()}
    shared = {alias: canonical for alias, canonical in (model.get("shared_params") or {}).items()}
    if not optim:
        if zero3:
            raise ExportError(f"'{folder.uri}' has no optimizer states files: a ZeRO-3 save's weights are only there")
        log.warning("no optimizer states in %s: exporting the 16-bit weights of %s", folder.uri, model_file)
        sources = {MODEL_STATES_RANK: _whole(model_zip, [*_flat_names(shapes), *frozen])}
        stage = 0
    else:
        zips = {rank: TorchZip(folder, optim[rank], STAND_INS, unsafe_pickle) for rank in range(world)}
        stage, sources = _optimizer_sources(folder, zips, shapes, world)
        if frozen and zero3:
            ranks = {rank: model_zip if rank == 0 else TorchZip(folder, zero3[rank], STAND_INS, unsafe_pickle) for rank in zero3}
            _add_partitioned_frozen(sources, frozen, ranks, world)
        elif frozen:
            sources[MODEL_STATES_RANK] = _whole(model_zip, list(frozen), "frozen_param_fragments")
    buffers = [name for name in model.get("buffer_names") or [] if isinstance((model.get("module") or {}).get(name), TensorRef)]
    if buffers:
        sources[MODEL_STATES_RANK] = sources.get(MODEL_STATES_RANK, ()) + _whole(model_zip, buffers)
    log.info("DeepSpeed ZeRO-%s checkpoint of %d rank(s) in %s%s", stage or "1/2 16-bit", world, folder.uri,
             f", ties {shared}" if shared else "")
    tags = {name for name in beside.folders() if TAG_FOLDER.match(name)} | {folder.uri[len(beside.uri):].strip("/")}
    return DeepSpeedCheckpoint(
        store=folder, world_size=world, layout=f"deepspeed-zero{stage}" if stage else "deepspeed-16bit",
        hf_folder=beside, nearby_hf_folder=beside.parent(), trainer_files=SAVE_FOLDER_FILES | tags, stage=stage,
        sources=sources,
    )


def _optimizer_sources(
    folder: Store, zips: dict[int, TorchZip], shapes: list[dict], world: int
) -> tuple[int, dict[int, tuple[Source, ...]]]:
    """The ZeRO stage, and each rank's runs of its fp32 buffers."""
    states = {rank: file.record.get("optimizer_state_dict") for rank, file in zips.items()}
    where = folder.display(zips[0].name)
    if not all(isinstance(state, dict) for state in states.values()):
        raise ExportError(f"'{where}' holds no optimizer_state_dict: not a DeepSpeed optimizer states file")
    stage = _stage(states[0].get("zero_stage"), where)
    key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    buffers = {rank: state.get(key) for rank, state in states.items()}
    if not all(isinstance(groups, list) and all(isinstance(g, TensorRef) for g in groups) for groups in buffers.values()):
        raise ExportError(f"'{where}' holds no {key}: a ZeRO-{stage} optimizer states file saves its fp32 weights there")
    counts = states[0].get("partition_count")
    counts = max(counts) if isinstance(counts, list) else counts
    if counts != world:
        raise ExportError(f"'{where}' was saved by {counts} ranks, but the model states say {world}")
    if any(len(groups) != len(buffers[0]) for groups in buffers.values()):
        raise ExportError(f"the ranks' {key} of '{folder.uri}' hold different numbers of groups: files from different saves?")
    if stage == 3:
        sizes = [group.numel for group in buffers[0]]
        if any([group.numel for group in groups] != sizes for groups in buffers.values()):
            raise ExportError(f"the ranks' {key} of '{folder.uri}' differ in size: files from different saves?")
        runs = zero3_runs(shapes, world, sizes)
    else:
        partitions = [[buffers[rank][group].numel for rank in range(world)] for group in range(len(buffers[0]))]
        runs = partitioned_runs(shapes, partitions, states[0].get("param_alignment_paddings"))
    shape_of = {name: shape for group in shapes for name, shape in group.items()}
    return stage, {
        rank: tuple(
            _source(zips[rank], run.name, shape_of[run.name], buffers[rank][run.buffer], run.at, run.length, run.start)
            for run in runs[rank] if run.length
        )
        for rank in range(world)
    }


def _add_partitioned_frozen(
    sources: dict[int, tuple[Source, ...]], frozen: dict[str, tuple[int, ...]], zips: dict[int, TorchZip], world: int
) -> None:
    """ZeRO-3's frozen parameters, each rank's partition of each in its own model states file."""
    names = list(frozen)
    for rank, runs in frozen_runs(frozen, world).items():
        fragments = zips[rank].record.get("frozen_param_fragments") or {}
        added = []
        for run in runs:
            fragment = fragments.get(names[run.buffer])
            if not isinstance(fragment, TensorRef):
                raise ExportError(f"'{zips[rank].display}' holds no fragment of frozen parameter '{names[run.buffer]}'")
            if run.length:
                added.append(_source(zips[rank], run.name, frozen[run.name], fragment, 0, run.length, run.start))
        sources[rank] = sources.get(rank, ()) + tuple(added)


def _whole(file: TorchZip, names: list[str], field_name: str = "module") -> tuple[Source, ...]:
    """Tensors held whole in rank 0's model states (`module`'s 16-bit weights, buffers, ZeRO-1/2's frozen parameters)."""
    held = file.record.get(field_name) or {}
    found = []
    for name in names:
        tensor = held.get(name)
        if not isinstance(tensor, TensorRef):
            raise ExportError(f"'{file.display}' holds no tensor '{name}' in {field_name}")
        found.append(_source(file, name, tensor.shape, tensor, 0, tensor.numel, None))
    return tuple(found)


def _source(file: TorchZip, name: str, shape: tuple[int, ...], tensor: TensorRef, at: int, length: int,
            start: int | None) -> Source:
    """The `Source` of `length` elements of `tensor` from its element `at`."""
    storage_start = file.byte_range(tensor)[0] - tensor.storage_offset * itemsize(tensor.dtype)
    return Source(name, shape, file.name, tensor, storage_start, tensor.storage_offset + at, length, start)


def _flat_names(shapes: list[dict]) -> list[str]:
    return [name for group in shapes for name in group]


def _by_rank(names: list[str], pattern: re.Pattern, group: int) -> dict[int, str]:
    found = {}
    for name in names:
        match = pattern.match(name)
        if match:
            found[int(match.groups()[group])] = name
    return found


def _int_field(record: dict, key: str, where: str) -> int:
    value = record.get(key)
    if not isinstance(value, int) or value < 1:
        raise ExportError(f"'{where}' records no {key}")
    return value


def _stage(value, where: str) -> int:
    """The ZeRO stage an optimizer states file records (DeepSpeed's `ZeroStageEnum`, by value)."""
    stage = value.args[0] if isinstance(value, StandIn) and value.args else value
    if stage not in (1, 2, 3):
        raise ExportError(f"'{where}' records ZeRO stage {stage!r:.40}; rayexport reads stages 1, 2 and 3")
    return stage


def _spans(sources: tuple[Source, ...]) -> dict[tuple[str, str], tuple[TensorRef, int, int]]:
    """Per (file, storage), the tensor and the element range [low, high) of it the sources need."""
    spans: dict[tuple[str, str], tuple[TensorRef, int, int]] = {}
    for source in sources:
        key = (source.file, source.tensor.key)
        tensor, low, high = spans.get(key, (source.tensor, source.at, source.at + source.length))
        spans[key] = tensor, min(low, source.at), max(high, source.at + source.length)
    return spans


def _span_bytes(span: tuple[TensorRef, int, int]) -> int:
    tensor, low, high = span
    return (high - low) * itemsize(tensor.dtype)


def _read_rank(store: Store, rank: int, sources: tuple[Source, ...], spool_dir: str, spooled: Advance) -> RunTensors:
    """One rank's sources as views of its buffers' bytes, memory-mapped from the files (a remote
    file's needed bytes spooled to one local file first)."""
    spool = None if store.is_local else os.path.join(spool_dir, f"deepspeed-rank-{rank}.bin")
    byte_starts = {(source.file, source.tensor.key): source.byte_start for source in sources}
    placed: dict[tuple[str, str], tuple[str, int, int]] = {}  # (file, storage) -> path, byte offset, first element
    with open(spool, "wb") if spool else contextlib.nullcontext() as out:
        for (name, key), (tensor, low, high) in _spans(sources).items():
            item = itemsize(tensor.dtype)
            begin, end = byte_starts[name, key] + low * item, byte_starts[name, key] + high * item
            if spool is None:
                placed[name, key] = store.path(name), begin, low
                continue
            placed[name, key] = spool, out.tell(), low
            for block in range(begin, end, _READ_BLOCK):
                data = store.read_range(name, block, min(end, block + _READ_BLOCK))
                out.write(data)
                spooled(len(data))
    spans = _spans(sources)
    mapped = {  # each span mapped once; every source is a view of its span
        key: map_range(path, offset, spans[key][2] - low, spans[key][0].dtype) for key, (path, offset, low) in placed.items()
    }
    tensors = {}
    for source in sources:
        low = placed[source.file, source.tensor.key][2]
        view = mapped[source.file, source.tensor.key][source.at - low:source.at - low + source.length]
        tensors[source.name] = view if source.start is not None else view.view(source.shape)
    paths = [spool] if spool else sorted({store.path(source.file) for source in sources})
    return RunTensors(tensors, {source.name: source for source in sources}, paths)
