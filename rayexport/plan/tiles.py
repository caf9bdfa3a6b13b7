"""Tiles: which box of which tensor each region of a converted tensor comes from.

transformers' weight conversions between a model's in-memory and on-disk names only move
elements (split, chunk, select, squeeze, transpose, cat, stack), so every converted tensor is
exactly a set of tiles over the tensors it was converted from. Planning an output tensor as
tiles lets each worker send just the slice of its shard that a tile needs, and nothing is
assembled beyond the bucket window. A tile may also take every k-th index of a source axis
(`steps`): a trainer's own names can need rows interleaved (torchtitan's Llama q and k). Pure
functions over shapes and offsets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Tile:
    """target[offset : offset + shape] is a box of tensor `source` starting at `source_offset`.
    Target axis i runs along source axis `axes[i]` (None: a unit axis the source lacks); a
    source axis no target axis runs along has extent 1 in the box. Along source axis a the box
    takes every `steps[a]`-th index (no steps: every index); along target axis i it lands on
    every `target_steps[i]`-th index from its offset (gpt-oss's gate and up columns, interleaved
    in Hugging Face's tensor; never along the first axis). Every element taken is multiplied
    by `scale` and `shift` added: a producer that saves a tensor less a constant (Megatron-Core's
    zero-centred norms, which Hugging Face's hold with their 1 added) needs it added back, and
    one that has no tensor where the model holds zeros (a value head's bias) gives them as 0 x a
    box of another."""

    source: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    source_offset: tuple[int, ...]
    axes: tuple[int | None, ...]
    steps: tuple[int, ...] = ()
    scale: float = 1.0
    shift: float = 0.0
    target_steps: tuple[int, ...] = ()

    def step(self, axis: int) -> int:
        """How far apart the box's indices along source axis `axis` are."""
        return self.steps[axis] if self.steps else 1

    def target_step(self, axis: int) -> int:
        """How far apart the box's places along target axis `axis` are."""
        return self.target_steps[axis] if self.target_steps else 1

    @property
    def source_shape(self) -> tuple[int, ...]:
        """The box's extent along each source axis."""
        extent = [1] * len(self.source_offset)
        for size, axis in zip(self.shape, self.axes):
            if axis is not None:
                extent[axis] = size
        return tuple(extent)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def whole(source: str, shape: tuple[int, ...]) -> Tile:
    """The tile of a tensor that is all of `source`, unchanged."""
    zeros = (0,) * len(shape)
    return Tile(source, zeros, tuple(shape), zeros, tuple(range(len(shape))))


def is_whole(tiles: tuple[Tile, ...], shape: tuple[int, ...], source_shape: tuple[int, ...]) -> bool:
    """Whether `tiles` of a target of `shape` are one whole source tensor of `source_shape`,
    unchanged (a plain rename)."""
    return len(tiles) == 1 and tuple(shape) == tuple(source_shape) and tiles[0] == whole(tiles[0].source, shape)


def _placed_densely(tiles: tuple[Tile, ...]) -> tuple[Tile, ...]:
    """`tiles`, none of which lands on every k-th index of the target: the moves below keep a
    tile's box in one piece of the target."""
    if any(tile.target_steps for tile in tiles):
        raise ValueError(f"a tile of '{tiles[0].source}' interleaved in its target cannot be moved further")
    return tiles


def narrow(tiles: tuple[Tile, ...], dim: int, start: int, length: int) -> tuple[Tile, ...]:
    """The tiles of `tensor.narrow(dim, start, length)`."""
    tiles, narrowed = _placed_densely(tiles), []
    for tile in tiles:
        low = max(start, tile.offset[dim])
        high = min(start + length, tile.offset[dim] + tile.shape[dim])
        if high <= low:
            continue
        source_offset = list(tile.source_offset)
        if tile.axes[dim] is not None:
            source_offset[tile.axes[dim]] += (low - tile.offset[dim]) * tile.step(tile.axes[dim])
        narrowed.append(replace(
            tile,
            offset=_set(tile.offset, dim, low - start),
            shape=_set(tile.shape, dim, high - low),
            source_offset=tuple(source_offset),
        ))
    return tuple(narrowed)


def drop_axis(tiles: tuple[Tile, ...], dim: int) -> tuple[Tile, ...]:
    """The tiles of `tensor.squeeze(dim)` for a unit `dim`."""
    tiles = _placed_densely(tiles)
    return tuple(
        replace(tile, offset=_drop(tile.offset, dim), shape=_drop(tile.shape, dim), axes=_drop(tile.axes, dim))
        for tile in tiles
    )


def insert_axis(tiles: tuple[Tile, ...], dim: int) -> tuple[Tile, ...]:
    """The tiles of `tensor.unsqueeze(dim)`."""
    tiles = _placed_densely(tiles)
    return tuple(
        replace(tile, offset=_insert(tile.offset, dim, 0), shape=_insert(tile.shape, dim, 1), axes=_insert(tile.axes, dim, None))
        for tile in tiles
    )


def permute(tiles: tuple[Tile, ...], order: tuple[int, ...]) -> tuple[Tile, ...]:
    """The tiles of `tensor.permute(order)`."""
    return tuple(
        replace(
            tile,
            offset=tuple(tile.offset[axis] for axis in order),
            shape=tuple(tile.shape[axis] for axis in order),
            axes=tuple(tile.axes[axis] for axis in order),
            target_steps=tuple(tile.target_steps[axis] for axis in order) if tile.target_steps else (),
        )
        for tile in tiles
    )


def concatenate(parts: list[tuple[tuple[Tile, ...], int]], dim: int) -> tuple[Tile, ...]:
    """The tiles of `torch.cat` along `dim` of tensors given as (tiles, size along dim)."""
    joined, position = [], 0
    for tiles, size in parts:
        tiles = _placed_densely(tiles)
        joined.extend(replace(tile, offset=_set(tile.offset, dim, tile.offset[dim] + position)) for tile in tiles)
        position += size
    return tuple(joined)


def invert(tile: Tile, target: str) -> Tile:
    """The same box seen the other way round: the region of `tile.source` that `target`
    (the tensor `tile` belongs to) provides."""
    if any(step != 1 for step in tile.steps + tile.target_steps) or tile.scale != 1 or tile.shift:
        raise ValueError(f"a tile of '{tile.source}' taking every k-th index, or changing its values, has no inverse")
    return Tile(
        source=target,
        offset=tile.source_offset,
        shape=tile.source_shape,
        source_offset=tile.offset,
        axes=tuple(tile.axes.index(axis) if axis in tile.axes else None for axis in range(len(tile.source_offset))),
    )


@dataclass(frozen=True)
class Selection:
    """What a worker sends for one tile of one shard: the box `region` (start, length, step per
    axis) of its local shard, laid out along the target's axes (`axes`, as in `Tile`), placed
    at `offset` in the target with extent `shape`, on every `steps[i]`-th index along axis i."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    region: tuple[tuple[int, int, int], ...]
    axes: tuple[int | None, ...]
    steps: tuple[int, ...] = ()


def select(tile: Tile, shard_offset: tuple[int, ...], shard_shape: tuple[int, ...]) -> Selection | None:
    """The part of a shard (at `shard_offset` in `tile.source`, of `shard_shape`) that lands in
    the tile's region of the target, or None when they do not meet."""
    region, firsts = [], []
    for axis, (start, extent, shard_start, shard_extent) in enumerate(
        zip(tile.source_offset, tile.source_shape, shard_offset, shard_shape)
    ):
        step = tile.step(axis)
        # the box's indices start + step * i, for i in [first, last), that fall in the shard
        first = max(0, -(-(shard_start - start) // step))
        last = min(extent, -(-(shard_start + shard_extent - start) // step))
        if last <= first:
            return None
        region.append((start + step * first - shard_start, last - first, step))
        firsts.append(first)
    offset = tuple(
        tile.offset[i] + (firsts[axis] * tile.target_step(i) if axis is not None else 0) for i, axis in enumerate(tile.axes)
    )
    shape = tuple(region[axis][1] if axis is not None else 1 for axis in tile.axes)
    return Selection(offset, shape, tuple(region), tile.axes, tile.target_steps)


class BoxIndex:
    """Which of many boxes of one tensor (each an offset and a shape: the pieces its ranks hold)
    a tile's source box meets, found for all of them at once rather than one `select` each: a
    235B MoE checkpoint saves a chunk per layer and expert, 12032 of one stacked tensor, cut
    into 36096 tiles."""

    def __init__(self, boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
        import numpy as np

        rank = len(boxes[0][0]) if boxes else 0
        self.low = np.array([offset for offset, _ in boxes], dtype=np.int64).reshape(len(boxes), rank)
        self.high = self.low + np.array([shape for _, shape in boxes], dtype=np.int64).reshape(len(boxes), rank)
        # The boxes sorted along the axis they are most cut on (a stacked tensor's layers or
        # experts): a tile's candidates are then one slice of them, found by bisection.
        self.axis = max(range(rank), key=lambda axis: len(np.unique(self.low[:, axis])), default=None)
        if self.axis is not None:
            self.order = np.argsort(self.low[:, self.axis], kind="stable")
            self.sorted_low = self.low[self.order, self.axis]
            self.reach = int((self.high - self.low)[:, self.axis].max(initial=0))  # the longest extent along it

    def meeting(self, tile: Tile) -> list[int]:
        """The positions of the boxes that the tile's source box meets, in order."""
        import numpy as np

        low = np.array(tile.source_offset, dtype=np.int64)
        high = low + np.array([(extent - 1) * tile.step(axis) + 1 for axis, extent in enumerate(tile.source_shape)],
                              dtype=np.int64)
        if self.axis is None:
            return list(range(len(self.low)))
        # a box meets the tile only if it starts within its longest extent before the tile's start, and before its end
        first = np.searchsorted(self.sorted_low, low[self.axis] - self.reach, side="right")
        last = np.searchsorted(self.sorted_low, high[self.axis], side="left")
        candidates = self.order[first:last]
        hits = np.all((self.low[candidates] < high) & (self.high[candidates] > low), axis=1)
        return np.sort(candidates[hits]).tolist()


@dataclass(frozen=True)
class RunSelection:
    """What a worker sends for one tile of a run of a flattened tensor: `length` elements from
    element `local_start` of its run, placed from element `target_start` of the flattened target."""

    target_start: int
    local_start: int
    length: int


def select_runs(
    tile: Tile, source_shape: tuple[int, ...], target_shape: tuple[int, ...], start: int, length: int
) -> list[RunSelection]:
    """The parts of a run of the flattened source (elements [start, start + length) of a tensor
    of `source_shape`) that land in the tile's region of a target of `target_shape`, each as
    contiguous in the run as in the flattened target.

    A box whose target axes run along the source's in order, every index taken, lists its
    elements in the same order in both tensors, so it is cut into chunks that are contiguous in
    both (their length: the shorter of the two tensors' contiguous stretches of the box), and a
    run meets a consecutive stretch of those chunks, found by bisection. A transposed or strided
    tile has no such chunks (ValueError)."""
    along = [axis for axis in tile.axes if axis is not None]
    if any(step != 1 for step in tile.steps + tile.target_steps) or along != sorted(along):
        raise ValueError(f"a transposed or strided tile of '{tile.source}' does not cut runs of its flattened elements")
    extent = tile.source_shape
    chunk = min(_contiguous(extent, source_shape), _contiguous(tile.shape, target_shape))
    chunks = math.prod(extent) // chunk if chunk else 0

    def source_start(index: int) -> int:
        return _flat_index(_unravel(index * chunk, extent), tile.source_offset, source_shape)

    low, high = 0, chunks  # the first chunk that ends after the run starts
    while low < high:
        middle = (low + high) // 2
        if source_start(middle) + chunk <= start:
            low = middle + 1
        else:
            high = middle
    selections = []
    for index in range(low, chunks):
        first = source_start(index)
        if first >= start + length:
            break
        begin, end = max(start, first), min(start + length, first + chunk)
        target = _flat_index(_unravel(index * chunk, tile.shape), tile.offset, target_shape)
        selections.append(RunSelection(target + begin - first, begin - start, end - begin))
    return selections


def _contiguous(box: tuple[int, ...], shape: tuple[int, ...]) -> int:
    """How many consecutive elements of a box of extent `box` in a tensor of `shape` are
    consecutive in the flattened tensor: the inner full axes and the first partial one."""
    length = 1
    for size, full in zip(reversed(box), reversed(shape)):
        length *= size
        if size != full:
            break
    return length


def _unravel(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    position = []
    for size in reversed(shape):
        position.append(index % size)
        index //= size
    return tuple(reversed(position))


def _flat_index(position: tuple[int, ...], offset: tuple[int, ...], shape: tuple[int, ...]) -> int:
    index = 0
    for at, start, size in zip(position, offset, shape):
        index = index * size + at + start
    return index


def _set(values: tuple, index: int, value) -> tuple:
    return values[:index] + (value,) + values[index + 1:]


def _drop(values: tuple, index: int) -> tuple:
    return values[:index] + values[index + 1:]


def _insert(values: tuple, index: int, value) -> tuple:
    return values[:index] + (value,) + values[index:]
