"""Writing: HF-convention safetensors shards streamed tensor by tensor, plus their index.

The header of each file is computed from the plan before any tensor arrives (safetensors has
no streaming writer), so each shard is written in one pass without holding it in memory.
"""

from __future__ import annotations

import json
import math
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

from huggingface_hub import StateDictSplit
from huggingface_hub.constants import SAFETENSORS_INDEX_FILE

from rayexport.common.digests import FAST, LEGACY, digest_of, new_digest
from rayexport.common.dtypes import SAFETENSORS_DTYPES, dtype_of
from rayexport.common.errors import ExportError
from rayexport.common.passes import Count, ignore
from rayexport.plan.naming import TensorPlan
from rayexport.plan.schedule import ShardFile
from rayexport.storage.store import Store

if TYPE_CHECKING:
    import torch

HEADER_METADATA = {"format": "pt"}


@dataclass(frozen=True)
class WrittenFile:
    """A file as written: its size, its fast digest, and with `--sha256` its SHA-256."""

    name: str
    size: int
    digest: str
    sha256: str | None = None

    def record(self) -> dict[str, object]:
        """The file's entry in the manifest's `files`."""
        return {"size": self.size, FAST: self.digest, **({LEGACY: self.sha256} if self.sha256 else {})}


def written_bytes(name: str, data: bytes, sha256: bool = False) -> WrittenFile:
    """The record of a small file written whole from `data`."""
    return WrittenFile(name, len(data), digest_of(data), digest_of(data, LEGACY) if sha256 else None)


def safetensors_header(tensors: list[TensorPlan]) -> bytes:
    """The length prefix and JSON header of a safetensors file holding `tensors` in order,
    padded with spaces to 8 bytes as the safetensors library does."""
    header: dict[str, object] = {"__metadata__": HEADER_METADATA}
    offset = 0
    for plan in tensors:
        header[plan.name] = {
            "dtype": SAFETENSORS_DTYPES[plan.dtype],
            "shape": list(plan.shape),
            "data_offsets": [offset, offset + plan.nbytes],
        }
        offset += plan.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def shard_file_size(tensors: list[TensorPlan]) -> int:
    """The size of the safetensors file that holds `tensors` in order: its header, then their bytes."""
    return len(safetensors_header(tensors)) + sum(plan.nbytes for plan in tensors)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a tensor, without a copy when it is contiguous."""
    import torch

    return memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())


def index_json(split: StateDictSplit) -> dict:
    """`model.safetensors.index.json` as transformers writes it, from huggingface_hub's split."""
    return {"metadata": dict(split.metadata), "weight_map": dict(sorted(split.tensor_to_filename.items()))}


def write_shards(
    store: Store,
    shard_files: list[ShardFile] | tuple[ShardFile, ...],
    plans: dict[str, TensorPlan],
    tensors: Iterator[tuple[str, list[torch.Tensor]]],
    on_tensor: Callable[[int], None] = lambda nbytes: None,
    sha256: bool = False,
    count: Count = ignore,
) -> tuple[list[WrittenFile], dict[str, str]]:
    """Stream `tensors` (in the planned order, each as consecutive chunks of its bytes) into
    their shard files, casting each chunk to the planned dtype.

    Returns each file's record (size, digest, with `sha256` its SHA-256) and each tensor's
    digest; a file becomes visible only once all its bytes are written. `count` gets the bytes
    of each pass (see `rayexport.common.passes`).
    """
    written, digests = [], {}
    # SHA-256 (--sha256) is taken in a second thread while this one writes and takes the fast
    # digests (hashlib lets go of the GIL on large buffers), so it costs the write little wall
    hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rayexport-sha256") if sha256 else None
    try:
        for shard in shard_files:
            written.append(_write_shard(store, shard, plans, tensors, on_tensor, digests, hasher, count))
    finally:
        if hasher is not None:
            hasher.shutdown()
    return written, digests


def _write_shard(
    store: Store,
    shard: ShardFile,
    plans: dict[str, TensorPlan],
    tensors: Iterator[tuple[str, list[torch.Tensor]]],
    on_tensor: Callable[[int], None],
    digests: dict[str, str],
    hasher: ThreadPoolExecutor | None,
    count: Count,
) -> WrittenFile:
    """One safetensors file: its header, then each tensor's bytes as they arrive."""
    ordered = [plans[name] for name in shard.tensors]
    header = safetensors_header(ordered)
    file_digest = new_digest()
    file_digest.update(header)
    file_sha256 = new_digest(LEGACY) if hasher is not None else None
    if file_sha256 is not None:
        file_sha256.update(header)
    size = len(header)
    with store.writer(shard.filename) as handle:
        handle.write(header)
        for plan in ordered:
            name, chunks = next(tensors, (None, []))
            shape = _chunked_shape(chunks, plan.shape)
            if name != plan.name or shape != plan.shape:
                raise ExportError(
                    f"internal error: expected tensor '{plan.name}' {list(plan.shape)}, "
                    f"got '{name}' {list(shape or ())}"
                )
            tensor_digest = new_digest()
            for chunk in chunks:
                cast = chunk.to(dtype_of(plan.dtype))
                if cast is not chunk or not cast.is_contiguous():
                    count("copied", cast.nbytes)
                data = tensor_bytes(cast)
                hashed = hasher.submit(file_sha256.update, data) if hasher is not None else None
                handle.write(data)
                file_digest.update(data)
                tensor_digest.update(data)
                count("written", len(data))
                count("hashed", 2 * len(data))
                if hashed is not None:
                    hashed.result()
                    count("hashed_sha256", len(data))
            digests[name] = tensor_digest.hexdigest()
            size += plan.nbytes
            on_tensor(plan.nbytes)
    sha256 = file_sha256.hexdigest() if file_sha256 is not None else None
    return WrittenFile(shard.filename, size, file_digest.hexdigest(), sha256)


def write_index(store: Store, split: StateDictSplit, sha256: bool = False) -> WrittenFile | None:
    """Write `model.safetensors.index.json` when the model spans several files."""
    if not split.is_sharded:
        return None
    data = (json.dumps(index_json(split), indent=2) + "\n").encode()
    store.write_bytes(SAFETENSORS_INDEX_FILE, data)
    return written_bytes(SAFETENSORS_INDEX_FILE, data, sha256)


def _chunked_shape(chunks: list[torch.Tensor], shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The shape of the tensor that `chunks` make up: consecutive runs of rows, or of the
    flattened elements of a tensor of `shape` (1-D chunks of a tensor that is not 1-D)."""
    if not chunks:
        return None
    if len(shape) != 1 and all(chunk.dim() == 1 for chunk in chunks):
        numel = sum(chunk.numel() for chunk in chunks)
        return tuple(shape) if numel == math.prod(shape) else (numel,)
    if len(chunks) == 1:
        return tuple(chunks[0].shape)
    return (sum(chunk.shape[0] for chunk in chunks),) + tuple(chunks[0].shape[1:])
