"""Where DeepSpeed ZeRO keeps each parameter's fp32 master weights: which run of which rank's flat
buffer holds which run of the parameter's flattened elements. Pure functions over the shapes
and sizes the checkpoint's files record, checked against DeepSpeed's own conversion
(`zero_to_fp32`) of real saves in tests/test_deepspeed.py.

- ZeRO-1 and ZeRO-2: each parameter group is one flat vector, the group's parameters one after
  another (each followed by its alignment padding, where recorded), cut into equal partitions,
  one per rank (`single_partition_of_fp32_groups`); a parameter can straddle ranks.
- ZeRO-3: each parameter is cut on its own into `ceil(numel / world)` elements per rank, the last
  rank's padded; a rank's flat buffer (`fp32_flat_groups`, one per group, concatenated) holds its
  partition of each parameter in turn. Frozen parameters are partitioned alike, each rank's in its
  model states file (`frozen_param_fragments`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rayexport.common.errors import ExportError

Shapes = list[dict[str, tuple[int, ...]]]  # each parameter group's parameters, in order, with shapes


@dataclass(frozen=True)
class Run:
    """Elements [start, start + length) of parameter `name`, flattened, held at [at, at + length)
    of flat buffer `buffer` of its rank."""

    name: str
    buffer: int
    at: int
    start: int
    length: int


def partitioned_runs(shapes: Shapes, partitions: list[list[int]], paddings: list[list[int]] | None) -> dict[int, list[Run]]:
    """ZeRO-1/2: each rank's runs, given each group's partition on each rank as saved (the last
    rank's without the padding that makes them equal: the concatenation is the group's flat
    vector) and the alignment padding after each parameter (None: none recorded)."""
    if len(partitions) != len(shapes):
        raise ExportError(f"the optimizer states hold {len(partitions)} parameter groups, the model states {len(shapes)}")
    world = len(partitions[0]) if partitions else 0
    runs: dict[int, list[Run]] = {rank: [] for rank in range(world)}
    for group, (parameters, sizes) in enumerate(zip(shapes, partitions)):
        padding = paddings[group] if paddings is not None else [0] * len(parameters)
        if len(padding) != len(parameters):
            raise ExportError(f"parameter group {group} records {len(padding)} paddings for its {len(parameters)} parameters")
        firsts = [sum(sizes[:rank]) for rank in range(world)]  # where each rank's partition starts
        position = 0
        for (name, shape), pad in zip(parameters.items(), padding):
            numel = math.prod(shape)
            for rank, (first, size) in enumerate(zip(firsts, sizes)):
                low, high = max(position, first), min(position + numel, first + size)
                if low < high:
                    runs[rank].append(Run(name, group, low - first, low - position, high - low))
            position += numel + pad
        if position - (padding[-1] if padding else 0) > sum(sizes):
            raise ExportError(f"parameter group {group} needs {position} elements, but its partitions hold {sum(sizes)}")
    return runs


def zero3_runs(shapes: Shapes, world: int, buffers: list[int]) -> dict[int, list[Run]]:
    """ZeRO-3: each rank's runs, given the sizes of each rank's flat buffers (the same on every rank)."""
    runs: dict[int, list[Run]] = {rank: [] for rank in range(world)}
    position = 0  # in a rank's buffers, one after another
    for parameters in shapes:
        for name, shape in parameters.items():
            numel = math.prod(shape)
            partition = math.ceil(numel / world)
            for rank in range(world):
                start = rank * partition
                length = max(0, min(partition, numel - start))
                runs[rank].extend(_split(Run(name, 0, position, start, length), buffers))
            position += partition
    if position != sum(buffers):
        raise ExportError(f"the parameters' ZeRO-3 partitions take {position} elements of each rank's {sum(buffers)}")
    return runs


def frozen_runs(shapes: dict[str, tuple[int, ...]], world: int) -> dict[int, list[Run]]:
    """ZeRO-3's frozen parameters: each rank's run of each, `buffer` its index in `shapes`
    (each rank's fragment of a parameter is a tensor of its own, its run at 0)."""
    runs: dict[int, list[Run]] = {rank: [] for rank in range(world)}
    for index, (name, shape) in enumerate(shapes.items()):
        numel = math.prod(shape)
        partition = math.ceil(numel / world)
        for rank in range(world):
            start = rank * partition
            runs[rank].append(Run(name, index, 0, start, max(0, min(partition, numel - start))))
    return runs


def _split(run: Run, buffers: list[int]) -> list[Run]:
    """`run`, placed at `run.at` of the buffers laid end to end, as runs of each buffer it falls in."""
    if not run.length:
        return [run]
    pieces, offset = [], 0
    for buffer, size in enumerate(buffers):
        low, high = max(run.at, offset), min(run.at + run.length, offset + size)
        if low < high:
            pieces.append(Run(run.name, buffer, low - offset, run.start + low - run.at, high - low))
        offset += size
    return pieces
