"""Scheduling: the output files (huggingface_hub's split rule, safetensors' order), which
worker reads which rank files or tensors, and the buckets each writer gathers, in the order
every worker steps through them. Pure functions.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Callable, TypeVar

from huggingface_hub import StateDictSplit, split_state_dict_into_shards_factory
from huggingface_hub.constants import SAFETENSORS_WEIGHTS_FILE_PATTERN

from rayexport.common.dtypes import SAFETENSORS_ORDER
from rayexport.plan.naming import TensorPlan
from rayexport.plan.pieces import Piece

T = TypeVar("T")

# Packed buffers keep every piece at an offset that any dtype can be viewed at.
PACK_ALIGNMENT = 16
# Buckets in flight per worker: one being written (or sent) while the next is received (or packed).
WINDOW = 2


@dataclass(frozen=True)
class ShardFile:
    """One output safetensors file and its tensors, in the order they are written."""

    filename: str
    tensors: tuple[str, ...]


@dataclass(frozen=True)
class Bucket:
    """Tensors gathered in one step by the worker that writes them; `sends[w]` are the pieces
    worker w packs, in order (the writer's own pieces never leave it)."""

    tensors: tuple[str, ...]
    sends: tuple[tuple[Piece, ...], ...]
    writer: int = 0


@dataclass(frozen=True)
class TransferPlan:
    """The whole gather: every bucket in the order all workers step through them, and the
    output files each writer streams (`files[w]`, in order)."""

    buckets: tuple[Bucket, ...]
    files: tuple[tuple[ShardFile, ...], ...]


def safetensors_order(tensors: list[TensorPlan]) -> list[TensorPlan]:
    """The order `safetensors.torch.save` lays tensors out in a file: by the library's dtype
    order, last first, then by name; matching it makes a streamed shard byte-identical to a
    library save."""
    return sorted(tensors, key=lambda plan: (-SAFETENSORS_ORDER[plan.dtype], plan.name))


# The least each writer is given of an export split for several writers: below it the write is
# short (about a second a GiB on one core), and the files huggingface_hub's rule makes are kept.
WRITER_SHARE = 2**30


def plan_shard_files(
    tensors: list[TensorPlan], max_shard_size: int, writers: int = 1
) -> tuple[list[ShardFile], StateDictSplit]:
    """Split the output into HF-convention files: huggingface_hub's greedy rule and names, or,
    with several `writers` and at least WRITER_SHARE for each, as many files as the writers (a
    multiple of them where `max_shard_size` needs more) of about equal size, so that each
    writer has an equal share. Returns each file with its tensors in write order, and the
    split, which the index is written from."""
    by_name = {plan.name: plan for plan in tensors}
    split = split_state_dict_into_shards_factory(
        by_name,
        get_storage_size=lambda plan: plan.nbytes,
        filename_pattern=SAFETENSORS_WEIGHTS_FILE_PATTERN,
        max_shard_size=max_shard_size,
    )
    sharing = min(writers, sum(plan.nbytes for plan in tensors) // WRITER_SHARE)
    if sharing > 1:
        split = _even_split(by_name, max_shard_size, sharing, len(split.filename_to_tensors))
    files = [
        ShardFile(
            filename=filename,
            tensors=tuple(plan.name for plan in safetensors_order([by_name[n] for n in names])),
        )
        for filename, names in split.filename_to_tensors.items()
    ]
    return files, split


def _even_split(by_name: dict[str, TensorPlan], max_shard_size: int, writers: int, least: int) -> StateDictSplit:
    """The tensors, in order, cut into a multiple of `writers` files (at least `least`) of
    about equal size, each within `max_shard_size` unless it holds one tensor larger than that;
    named as huggingface_hub names a split (its own splitter only fills files to the limit)."""
    names, sizes = list(by_name), [plan.nbytes for plan in by_name.values()]
    count = min(len(sizes), -(-least // writers) * writers)
    while True:
        cuts = _even_cuts(sizes, count)
        runs = list(zip(cuts, cuts[1:]))
        if count >= len(sizes) or all(sum(sizes[a:b]) <= max_shard_size or b - a == 1 for a, b in runs):
            break
        count = min(len(sizes), count + writers)
    filename_to_tensors = {
        SAFETENSORS_WEIGHTS_FILE_PATTERN.format(suffix=f"-{number:05d}-of-{len(runs):05d}"): names[a:b]
        for number, (a, b) in enumerate(runs, start=1)
    }
    return StateDictSplit(
        metadata={"total_size": sum(sizes)},
        filename_to_tensors=filename_to_tensors,
        tensor_to_filename={name: filename for filename, run in filename_to_tensors.items() for name in run},
    )


def _even_cuts(sizes: list[int], count: int) -> list[int]:
    """Where to cut `sizes`, in order, into `count` non-empty runs of about equal sums: at each
    j/count of the total, the nearest tensor boundary (0 and len(sizes) included)."""
    ends = list(itertools.accumulate(sizes, initial=0))
    cuts = [0]
    for part in range(1, count):
        target = ends[-1] * part / count
        low, high = cuts[-1] + 1, len(sizes) - (count - part)  # every run keeps a tensor
        above = bisect.bisect_left(ends, target)  # the first boundary at or past the target
        candidates = {min(max(cut, low), high) for cut in (above - 1, above)}
        cuts.append(min(candidates, key=lambda cut: (abs(ends[cut] - target), cut)))
    return cuts + [len(sizes)]


def assign_ranks(ranks: list[int], num_workers: int) -> dict[int, int]:
    """Spread the rank files to read over the workers in contiguous blocks; rank 0 stays on
    worker 0, the exporter, so its shards never cross the network."""
    ranks = sorted(ranks)
    per_worker = math.ceil(len(ranks) / num_workers)
    return {rank: position // per_worker for position, rank in enumerate(ranks)}


def assign_by_bytes(sizes: dict[str, int], num_workers: int) -> list[list[str]]:
    """Split the keys of `sizes` (key -> bytes) over `num_workers` workers with about equal bytes
    each: greedy largest-first onto the least loaded worker, ties broken by key and worker index,
    so the same checkpoint always gets the same assignment. Each worker's keys are sorted."""
    if num_workers < 1:
        raise ValueError(f"num_workers must be at least 1, not {num_workers}")
    loads = [(0, worker) for worker in range(num_workers)]
    assigned: list[list[str]] = [[] for _ in range(num_workers)]
    for key, size in sorted(sizes.items(), key=lambda item: (-item[1], item[0])):
        load, worker = heapq.heappop(loads)
        assigned[worker].append(key)
        heapq.heappush(loads, (load + size, worker))
    return [sorted(keys) for keys in assigned]


def keep_ties_together(
    keys_by_worker: list[list[str]], aliases: dict[str, str], name_of: dict[str, str]
) -> list[list[str]]:
    """Move every key of a tie group to one worker, that of the group's canonical tensor when
    the checkpoint holds it, so the saved copies can be compared where they are read (DCP
    stores each copy). Groups are matched on model names (`name_of`: source key -> model name,
    e.g. without `_orig_mod.`), as the planning later matches them."""
    group_of = {key: aliases.get(name_of.get(key, key), name_of.get(key, key)) for keys in keys_by_worker for key in keys}
    worker_of_group: dict[str, int] = {}
    for worker, keys in enumerate(keys_by_worker):
        for key in keys:
            if name_of.get(key, key) == group_of[key]:
                worker_of_group[group_of[key]] = worker
    for worker, keys in enumerate(keys_by_worker):
        for key in keys:
            worker_of_group.setdefault(group_of[key], worker)
    moved: list[list[str]] = [[] for _ in keys_by_worker]
    for keys in keys_by_worker:
        for key in keys:
            moved[worker_of_group[group_of[key]]].append(key)
    return moved


def assign_writers(files: list[ShardFile], plans: dict[str, TensorPlan], writers: int) -> list[int]:
    """The writer of each output file: largest files first, each to the least-loaded writer
    (ties to the lowest index), so `writers` workers upload about equal bytes."""
    loads = [0] * writers
    writer_of = [0] * len(files)
    sizes = [sum(plans[name].nbytes for name in shard.tensors) for shard in files]
    for position in sorted(range(len(files)), key=lambda position: (-sizes[position], position)):
        writer = min(range(writers), key=lambda writer: (loads[writer], writer))
        writer_of[position] = writer
        loads[writer] += sizes[position]
    return writer_of


def group_by_bytes(items: list[T], size_of: Callable[[T], int], budget: int) -> list[list[T]]:
    """`items` in order, cut into consecutive groups of at most `budget` bytes by `size_of`
    (an item larger than `budget` makes a group of its own)."""
    groups: list[list[T]] = []
    size = 0
    for item in items:
        item_size = size_of(item)
        if not groups or size + item_size > budget:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += item_size
    return groups


def plan_buckets(
    tensors_in_order: list[TensorPlan],
    worker_of_rank: dict[int, int],
    num_workers: int,
    bucket_size: int,
    writer: int = 0,
) -> list[Bucket]:
    """Group output tensors, in write order, into buckets of at most `bucket_size` gathered
    bytes (a larger tensor travels alone), each gathered to `writer` in one step."""
    buckets = []
    for group in group_by_bytes(tensors_in_order, lambda plan: sum(piece.nbytes for piece in plan.all_pieces), bucket_size):
        sends: list[list[Piece]] = [[] for _ in range(num_workers)]
        for plan in group:
            for piece in plan.all_pieces:
                sends[worker_of_rank[piece.rank]].append(piece)
        buckets.append(
            Bucket(tensors=tuple(plan.name for plan in group), sends=tuple(map(tuple, sends)), writer=writer)
        )
    return buckets


def plan_transfer(
    files: list[ShardFile],
    plans: dict[str, TensorPlan],
    worker_of_rank: dict[int, int],
    num_workers: int,
    bucket_size: int,
    writers: int = 1,
) -> TransferPlan:
    """Bucket each writer's files in write order, then interleave the writers' buckets so that
    while one writer uploads, the next bucket is already on its way to another."""
    writers = max(1, min(writers, num_workers, len(files) or 1))
    writer_of = assign_writers(files, plans, writers)
    files_of = [tuple(shard for shard, owner in zip(files, writer_of) if owner == writer) for writer in range(writers)]
    queues = [
        plan_buckets(
            [plans[name] for shard in files_of[writer] for name in shard.tensors],
            worker_of_rank, num_workers, bucket_size, writer,
        )
        for writer in range(writers)
    ]
    interleaved = [bucket for round_ in itertools.zip_longest(*queues) for bucket in round_ if bucket is not None]
    return TransferPlan(tuple(interleaved), tuple(files_of) + ((),) * (num_workers - writers))


def packed_offsets(pieces: tuple[Piece, ...]) -> tuple[list[int], int]:
    """Byte offset of each piece in a packed buffer, and the buffer's size."""
    offsets, position = [], 0
    for piece in pieces:
        offsets.append(position)
        position += -(-piece.nbytes // PACK_ALIGNMENT) * PACK_ALIGNMENT
    return offsets, position


def wire_bytes(bucket: Bucket, rank: int) -> int:
    """Bytes `rank` moves over the network in one bucket: what every other worker sends it when
    it writes the bucket, else what it sends (a writer's own pieces never travel)."""
    if bucket.writer == rank:
        return sum(packed_offsets(pieces)[1] for worker, pieces in enumerate(bucket.sends) if worker != rank)
    return packed_offsets(bucket.sends[rank])[1]


def staging_bytes(buckets: tuple[Bucket, ...], rank: int) -> int:
    """The largest number of bytes `rank` sends or receives in one bucket: the size of each of
    its staging buffers (the gather holds `WINDOW` of them)."""
    return max((wire_bytes(bucket, rank) for bucket in buckets), default=0)


def sent_bytes(buckets: tuple[Bucket, ...], rank: int) -> int:
    """Bytes `rank` sends over the network in the gather (to other writers)."""
    return sum(wire_bytes(bucket, rank) for bucket in buckets if bucket.writer != rank)


def received_bytes(buckets: tuple[Bucket, ...], rank: int) -> int:
    """Bytes `rank` receives over the network in the gather (its own pieces never travel)."""
    return sum(wire_bytes(bucket, rank) for bucket in buckets if bucket.writer == rank)
