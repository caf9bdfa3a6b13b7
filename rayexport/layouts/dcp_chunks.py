"""A DCP checkpoint read in place: each saved chunk of each model tensor is the `torch.save`
record that DCP's FileSystemWriter wrote at a byte range of a `.distcp` file. On a filesystem the
workers see, its tensor bytes are memory-mapped where they lie (`read_in_place`); in object
storage, each piece the transfer asks for is fetched as the byte range of its chunk that holds
it, when it is asked for (`RemoteChunks`). Nothing is copied to a spool either way. Workers
share the chunks by bytes (`share_chunks`, pure), so a stacked Megatron tensor or an FSDP save's
dim-0 shards spread over all of them; a worker holds its chunks as pseudo-ranks, the k-th of
each tensor in its k-th (`slot_chunks`).

How a file's records are found is written here rather than left to `torch.distributed.checkpoint.load`:
torch's reader copies every chunk into a tensor the caller allocates, which for a worker's share
means either its memory or a local spool file as large as the share (a 235B checkpoint's share
is hundreds of GB), and re-reads `.metadata` for every call.
"""

from __future__ import annotations

import concurrent.futures
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from rayexport.common.dtypes import dtype_of, itemsize
from rayexport.common.errors import ExportError
from rayexport.layouts.base import Advance, MappedTensors, SourceTensors
from rayexport.layouts.mapped import FileMaps
from rayexport.layouts.torch_zip import TensorRef, TorchZip
from rayexport.plan.pieces import Piece, piece_tensor
from rayexport.plan.schedule import assign_by_bytes
from rayexport.plan.shards import ShardInfo
from rayexport.storage.store import Store

if TYPE_CHECKING:
    import torch
    from torch.distributed.checkpoint.metadata import Metadata

    from rayexport.layouts.dcp_metadata import DcpTensor


@dataclass(frozen=True)
class DcpChunk:
    """One saved chunk of model tensor `key`: its box (`offset`, `sizes`) in the tensor, and the
    byte range [start, start + length) of the `.distcp` file `file` that holds its record."""

    key: str
    offset: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    start: int
    length: int
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.sizes) * itemsize(self.dtype)


def list_chunks(tensors: dict[str, DcpTensor], metadata: Metadata, uri: str) -> list[DcpChunk]:
    """Every saved chunk of `tensors` (by model key), as `.metadata` places them, in key order;
    one line naming the tensor whose chunk no file holds, or whose record DCP transformed
    (compressed) on save."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    chunks = []
    for model_key, tensor in tensors.items():
        seen = set()
        for chunk in metadata.state_dict_metadata[tensor.key].chunks:
            offset = tuple(int(at) for at in chunk.offsets)
            if offset in seen:
                continue
            seen.add(offset)
            info = storage.get(MetadataIndex(tensor.key, chunk.offsets))
            if getattr(info, "relative_path", None) is None:
                raise ExportError(f"no file of DCP checkpoint '{uri}' holds the chunk at {list(offset)} of '{tensor.key}'")
            if getattr(info, "transform_descriptors", None):
                raise ExportError(
                    f"the chunks of '{tensor.key}' in DCP checkpoint '{uri}' were saved through "
                    f"{', '.join(info.transform_descriptors)}, which rayexport does not read"
                )
            chunks.append(DcpChunk(
                model_key, offset, tuple(int(size) for size in chunk.sizes), info.relative_path,
                int(info.offset), int(info.length), tensor.dtype,
            ))
    return chunks


def _units(chunks: list[DcpChunk], tie_groups: dict[str, str]) -> dict[tuple, list[DcpChunk]]:
    """The chunks by (tie group, box): a tensor's chunk alone, or one box of every tied copy
    saved in it, which are read, and compared, together."""
    units: dict[tuple, list[DcpChunk]] = {}
    for chunk in chunks:
        units.setdefault((tie_groups.get(chunk.key, chunk.key), chunk.offset, chunk.sizes), []).append(chunk)
    return units


def share_chunks(
    chunks: list[DcpChunk], num_workers: int, tie_groups: dict[str, str], file_readers: dict[str, int] | None = None,
) -> dict[int, list[DcpChunk]]:
    """Each worker's chunks: about equal bytes each, the same box of tied tensors (`tie_groups`:
    model key -> its group's canonical key) on one worker; where `file_readers` places the files,
    each chunk on its file's reader."""
    units = _units(chunks, tie_groups)
    if file_readers is not None:
        worker_of = {unit: file_readers[members[0].file] for unit, members in units.items()}
    else:
        names = {unit: f"{index:012d}" for index, unit in enumerate(units)}
        sizes = {names[unit]: sum(chunk.nbytes for chunk in members) for unit, members in units.items()}
        assigned = assign_by_bytes(sizes, num_workers)
        worker_by_name = {name: worker for worker, keys in enumerate(assigned) for name in keys}
        worker_of = {unit: worker_by_name[names[unit]] for unit in units}
    shares: dict[int, list[DcpChunk]] = {}
    for unit, members in units.items():
        shares.setdefault(worker_of[unit], []).extend(members)
    return shares


def slot_chunks(chunks: list[DcpChunk], tie_groups: dict[str, str]) -> list[list[DcpChunk]]:
    """A worker's chunks as pseudo-ranks, each holding at most one chunk of a tensor: the k-th
    slot the k-th box (by offset) of each tensor, or of each tie group, whose copies saved in
    that box meet there, where they are compared (copies saved in other boxes never meet)."""
    by_group: dict[str, list[tuple]] = {}
    units = _units(chunks, tie_groups)
    for unit in units:
        by_group.setdefault(unit[0], []).append(unit)
    slots: list[list[DcpChunk]] = []
    for group in sorted(by_group):
        for slot, unit in enumerate(sorted(by_group[group], key=lambda unit: (unit[1], unit[2]))):
            while len(slots) <= slot:
                slots.append([])
            slots[slot].extend(units[unit])
    return slots


class ChunkTensors(MappedTensors):
    """One pseudo-rank's chunks, by model key: views of the `.distcp` files, mapped in place
    (`maps`, the files its worker mapped, each once for all its pseudo-ranks)."""

    def __init__(self, tensors: dict, chunks: dict[str, DcpChunk], shapes: dict[str, tuple[int, ...]], maps: FileMaps):
        super().__init__(tensors, None)
        self.chunks, self.shapes, self.maps = chunks, shapes, maps

    def mapped_ranges(self) -> list[tuple[int, int]]:
        return self.maps.ranges()

    def describe(self, advance: Advance = lambda count: None) -> dict[str, ShardInfo]:
        return describe_chunks(self.chunks, self.shapes, advance)


# Records parsed, and pieces fetched, at once from object storage by one worker.
REQUESTS_IN_FLIGHT = 8


def _record_start(store: Store, chunk: DcpChunk, unsafe_pickle: bool) -> int:
    """Where the tensor bytes of `chunk`'s record start in its file, after checking the record
    against `.metadata` (dtype, sizes), so that a file rewritten since the plan read it is refused
    in one line rather than read as other bytes."""
    where = f"the chunk at {list(chunk.offset)} of '{chunk.key}' in '{store.display(chunk.file)}'"
    try:
        record = TorchZip(store, chunk.file, unsafe=unsafe_pickle, window=(chunk.start, chunk.length))
    except ExportError as error:
        raise ExportError(f"{where} is not the torch.save record .metadata places there ({error})") from None
    found = record.record
    if not isinstance(found, TensorRef) or found.dtype != chunk.dtype or found.shape != chunk.sizes:
        what = f"a {found.dtype} tensor of shape {list(found.shape)}" if isinstance(found, TensorRef) else "no tensor"
        raise ExportError(
            f"{where} holds {what}, not the {chunk.dtype} {list(chunk.sizes)} its .metadata lists: changed since it was listed?"
        )
    return record.byte_range(found)[0]


def describe_chunks(
    chunks: dict[str, DcpChunk], shapes: dict[str, tuple[int, ...]], advance: Advance = lambda count: None,
) -> dict[str, ShardInfo]:
    """Each chunk, placed in its tensor."""
    infos = {}
    for key, chunk in chunks.items():
        infos[key] = ShardInfo(local_shape=chunk.sizes, dtype=chunk.dtype, global_shape=shapes[key], offset=chunk.offset)
        advance(chunk.nbytes)
    return infos


def read_in_place(
    store: Store, slots: dict[int, list[DcpChunk]], shapes: dict[str, tuple[int, ...]], unsafe_pickle: bool = False,
) -> dict[int, ChunkTensors]:
    """Each pseudo-rank's chunks, each a view of its bytes where they lie in a local (or shared
    filesystem's) `.distcp` file, every file memory-mapped once: nothing is read until the
    transfer touches it."""
    maps = FileMaps()
    held = {}
    for rank, chunks in slots.items():
        tensors = {}
        for chunk in sorted(chunks, key=lambda chunk: (chunk.file, chunk.start)):
            start = _record_start(store, chunk, unsafe_pickle)
            tensors[chunk.key] = maps.view(store.path(chunk.file), start, math.prod(chunk.sizes), chunk.dtype).view(chunk.sizes)
        held[rank] = ChunkTensors(tensors, {chunk.key: chunk for chunk in chunks}, shapes, maps)
    return held


class RemoteChunks(SourceTensors):
    """One pseudo-rank's chunks of a checkpoint in object storage, by model key. Nothing is
    fetched ahead: each piece the transfer asks for (`values`) is the byte range of its chunk
    from its first element to its last, one ranged request, so that a worker holds at most the
    pieces of the bucket it is on, and needs no local disk."""

    fetches = True

    def __init__(
        self, store: Store, chunks: dict[str, DcpChunk], starts: dict[str, int], shapes: dict[str, tuple[int, ...]],
    ) -> None:
        self.store, self.chunks, self.starts, self.shapes = store, chunks, starts, shapes

    def __getitem__(self, key: str) -> torch.Tensor:
        """The whole chunk of `key`, fetched (to compare tied copies)."""
        chunk = self.chunks[key]
        return self._fetch(chunk, 0, math.prod(chunk.sizes)).view(chunk.sizes)

    def __iter__(self):
        return iter(self.chunks)

    def __len__(self) -> int:
        return len(self.chunks)

    def describe(self, advance: Advance = lambda count: None) -> dict[str, ShardInfo]:
        return describe_chunks(self.chunks, self.shapes, advance)

    def values(self, piece: Piece) -> torch.Tensor:
        """What `piece` takes from its chunk, fetched as the one byte range that holds it."""
        chunk = self.chunks[piece.source_key]
        if piece.region is None:
            return piece_tensor(self[piece.source_key], piece)
        strides = [math.prod(chunk.sizes[axis + 1:]) for axis in range(len(chunk.sizes))]
        first = sum(start * stride for (start, _, _), stride in zip(piece.region, strides))
        last = sum((start + (length - 1) * step) * stride for (start, length, step), stride in zip(piece.region, strides))
        if any(length == 0 for _, length, _ in piece.region):
            first, last = 0, -1
        flat = self._fetch(chunk, first, last + 1 - first)
        box = flat.as_strided(
            [length for _, length, _ in piece.region], [stride * step for (_, _, step), stride in zip(piece.region, strides)]
        )
        return piece_tensor(box, replace(piece, region=tuple((0, length, 1) for _, length, _ in piece.region)))

    def _fetch(self, chunk: DcpChunk, first: int, count: int) -> torch.Tensor:
        """`count` elements of `chunk` from its element `first`, fetched into memory."""
        import torch

        item = itemsize(chunk.dtype)
        begin = self.starts[chunk.key] + first * item
        data = bytearray(self.store.read_range(chunk.file, begin, begin + count * item)) if count > 0 else bytearray()
        if len(data) != max(count, 0) * item:
            raise ExportError(f"'{self.store.display(chunk.file)}' ends inside the chunk of '{chunk.key}': changed since it was listed?")
        return torch.frombuffer(data, dtype=dtype_of(chunk.dtype)) if data else torch.empty(0, dtype=dtype_of(chunk.dtype))


def read_remote(
    store: Store, slots: dict[int, list[DcpChunk]], shapes: dict[str, tuple[int, ...]], unsafe_pickle: bool = False,
) -> dict[int, RemoteChunks]:
    """Each pseudo-rank's chunks of a checkpoint in object storage, each record found and checked
    (several at once), none of their tensor bytes fetched yet."""
    chunks = [chunk for held in slots.values() for chunk in held]
    with concurrent.futures.ThreadPoolExecutor(REQUESTS_IN_FLIGHT) as pool:
        starts = dict(zip(chunks, pool.map(lambda chunk: _record_start(store, chunk, unsafe_pickle), chunks)))
    return {
        rank: RemoteChunks(store, {chunk.key: chunk for chunk in held}, {chunk.key: starts[chunk] for chunk in held}, shapes)
        for rank, held in slots.items()
    }
