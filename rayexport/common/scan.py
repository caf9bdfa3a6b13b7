"""Bounded passes over tensor values: finiteness and tied-copy differences, a fixed number of
elements at a time, so checking a tensor never holds more than a chunk's upcast copy."""

from __future__ import annotations

from typing import Iterator

import torch

# 1 Mi elements: a float64 copy of one chunk is 8 MiB, whatever the tensor's size.
CHUNK_ELEMENTS = 2**20


def flat_chunks(tensor: torch.Tensor, elements: int = CHUNK_ELEMENTS) -> Iterator[torch.Tensor]:
    """`tensor`'s values in row-major order, `elements` at a time (views where it is contiguous)."""
    flat = tensor.reshape(-1)
    for start in range(0, flat.numel(), elements):
        yield flat[start:start + elements]


def is_finite(tensor: torch.Tensor, elements: int = CHUNK_ELEMENTS) -> bool:
    """No NaN or Inf in a tensor. min and max propagate NaN and reach Inf, and one aminmax pass
    is many times faster than materialising isfinite's mask. Chunks are upcast to float32 where
    torch has no aminmax for the dtype (float8)."""
    if not tensor.is_floating_point():
        return True
    upcast = tensor.dtype.itemsize == 1
    for chunk in flat_chunks(tensor, elements):
        low, high = torch.aminmax(chunk.float() if upcast else chunk)
        if not (torch.isfinite(low) and torch.isfinite(high)):
            return False
    return True


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
