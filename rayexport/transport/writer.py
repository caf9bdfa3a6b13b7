"""Writing: HF-convention safetensors shards streamed tensor by tensor, plus their index.

The header of each file is computed from the plan before any tensor arrives (safetensors has
no streaming writer), so each shard is written in one pass without holding it in memory.
"""

from __future__ import annotations

import hashlib
import json
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from huggingface_hub import StateDictSplit
from huggingface_hub.constants import SAFETENSORS_INDEX_FILE

from rayexport.common.dtypes import SAFETENSORS_DTYPES, dtype_of
from rayexport.common.errors import ExportError
from rayexport.plan.naming import TensorPlan
from rayexport.plan.schedule import ShardFile
from rayexport.storage.store import Store

HEADER_METADATA = {"format": "pt"}


@dataclass(frozen=True)
class WrittenFile:
    name: str
    size: int
    sha256: str


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


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a tensor, without a copy when it is contiguous."""
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
) -> tuple[list[WrittenFile], dict[str, str]]:
    """Stream `tensors` (in the planned order, each as consecutive chunks of its bytes) into
    their shard files, casting each chunk to the planned dtype.

    Returns each file's size and sha256, and each tensor's sha256; a file becomes visible only
    once all its bytes are written.
    """
    written, digests = [], {}
    # the tensor's digest is taken in a second thread while this one writes and takes the file's
    # (hashlib lets go of the GIL on large buffers), so the two sha256 passes cost about one
    hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rayexport-digest")
    try:
        for shard in shard_files:
            written.append(_write_shard(store, shard, plans, tensors, on_tensor, digests, hasher))
    finally:
        hasher.shutdown()
    return written, digests


def _write_shard(
    store: Store,
    shard: ShardFile,
    plans: dict[str, TensorPlan],
    tensors: Iterator[tuple[str, list[torch.Tensor]]],
    on_tensor: Callable[[int], None],
    digests: dict[str, str],
    hasher: ThreadPoolExecutor,
) -> WrittenFile:
    """One safetensors file: its header, then each tensor's bytes as they arrive."""
    ordered = [plans[name] for name in shard.tensors]
    header = safetensors_header(ordered)
    file_digest = hashlib.sha256(header)
    size = len(header)
    with store.writer(shard.filename) as handle:
        handle.write(header)
        for plan in ordered:
            name, chunks = next(tensors, (None, []))
            shape = _chunked_shape(chunks)
            if name != plan.name or shape != plan.shape:
                raise ExportError(
                    f"internal error: expected tensor '{plan.name}' {list(plan.shape)}, "
                    f"got '{name}' {list(shape or ())}"
                )
            tensor_digest = hashlib.sha256()
            for chunk in chunks:
                data = tensor_bytes(chunk.to(dtype_of(plan.dtype)))
                hashed = hasher.submit(tensor_digest.update, data)
                handle.write(data)
                file_digest.update(data)
                hashed.result()
            digests[name] = tensor_digest.hexdigest()
            size += plan.nbytes
            on_tensor(plan.nbytes)
    return WrittenFile(shard.filename, size, file_digest.hexdigest())


def write_index(store: Store, split: StateDictSplit) -> WrittenFile | None:
    """Write `model.safetensors.index.json` when the model spans several files."""
    if not split.is_sharded:
        return None
    data = (json.dumps(index_json(split), indent=2) + "\n").encode()
    store.write_bytes(SAFETENSORS_INDEX_FILE, data)
    return WrittenFile(SAFETENSORS_INDEX_FILE, len(data), hashlib.sha256(data).hexdigest())


def _chunked_shape(chunks: list[torch.Tensor]) -> tuple[int, ...] | None:
    """The shape of the tensor that `chunks` (consecutive runs of rows) make up."""
    if not chunks:
        return None
    if len(chunks) == 1:
        return tuple(chunks[0].shape)
    return (sum(chunk.shape[0] for chunk in chunks),) + tuple(chunks[0].shape[1:])
