"""Bounded passes over tensor values: finiteness, digests and tied-copy differences, a fixed
number of elements at a time, so checking a tensor never holds more than a chunk's upcast copy."""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from rayexport.common.digests import new_digest
from rayexport.common.passes import Count, ignore

# 1 Mi elements: a float64 copy of one chunk is 8 MiB, whatever the tensor's size.
CHUNK_ELEMENTS = 2**20


def flat_chunks(tensor: torch.Tensor, elements: int = CHUNK_ELEMENTS) -> Iterator[torch.Tensor]:
    """`tensor`'s values in row-major order, `elements` at a time: views where it is
    contiguous; a strided view (a region of a tensor) is copied a block of rows at a time, so
    only a block is ever copied."""
    if not tensor.is_contiguous() and tensor.dim() > 1:
        rows = max(1, elements // max(1, tensor[0].numel()))
        for block in tensor.split(rows):
            yield from flat_chunks(block.contiguous(), elements)
        return
    flat = tensor.reshape(-1)
    for start in range(0, flat.numel(), elements):
        yield flat[start:start + elements]


def is_finite(tensor: torch.Tensor, elements: int = CHUNK_ELEMENTS) -> bool:
    """No NaN or Inf in a tensor."""
    return all(_chunk_is_finite(chunk) for chunk in flat_chunks(tensor, elements))


def _chunk_is_finite(chunk: torch.Tensor) -> bool:
    """min and max propagate NaN and reach Inf, and one aminmax pass is many times faster than
    materialising isfinite's mask. Chunks are upcast to float32 where torch has no aminmax for
    the dtype (float8)."""
    if not chunk.is_floating_point() or not chunk.numel():
        return True
    low, high = torch.aminmax(chunk.float() if chunk.dtype.itemsize == 1 else chunk)
    return bool(torch.isfinite(low) and torch.isfinite(high))


def scan_and_digest(
    blocks: Iterable[torch.Tensor], dtype: torch.dtype | None, count: Count = ignore, elements: int = CHUNK_ELEMENTS,
) -> tuple[bool, str | None]:
    """One pass over a tensor's values, given as consecutive blocks (the tensor itself, or the
    blocks of rows a LoRA merge yields), a chunk at a time while it is in cache: whether every
    value is finite, and, given the output `dtype`, the fast digest of the bytes after the cast
    to it (None without). `count` gets the bytes scanned, cast and hashed."""
    finite, digest = True, new_digest() if dtype is not None else None
    for block in blocks:
        if not block.is_contiguous():
            count("copied", block.nbytes)  # made contiguous a block of rows at a time
        for chunk in flat_chunks(block, elements):
            finite = finite and _chunk_is_finite(chunk)
            count("scanned", chunk.nbytes)
            if digest is None:
                continue
            cast = chunk.to(dtype)
            if cast is not chunk:
                count("copied", cast.nbytes)
            digest.update(cast.contiguous().view(torch.uint8).numpy())
            count("hashed", cast.nbytes)
    return finite, digest.hexdigest() if digest is not None else None


def max_abs_difference(first: torch.Tensor, second: torch.Tensor, elements: int = CHUNK_ELEMENTS) -> float:
    """max |first - second| over two tensors of one shape; inf when the shapes differ. Equal
    chunks are skipped without a copy; a differing chunk is compared in float64."""
    if first.shape != second.shape:
        return float("inf")
    worst = 0.0
    for one, other in zip(flat_chunks(first, elements), flat_chunks(second, elements)):
        if not torch.equal(one, other):
            worst = max(worst, (one.double() - other.double()).abs().max().item())
    return worst
