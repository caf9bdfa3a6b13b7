"""Dtype names shared by every stage: torch's names, and safetensors' codes in its own order.
Planning uses the names and sizes without importing torch (the command line starts Ray first)."""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch dtype name -> safetensors dtype code, listed in the safetensors library's dtype order,
# which decides the layout of tensors in a file.
SAFETENSORS_DTYPES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "float8_e5m2": "F8_E5M2",
    "float8_e4m3fn": "F8_E4M3",
    "int16": "I16",
    "uint16": "U16",
    "float16": "F16",
    "bfloat16": "BF16",
    "int32": "I32",
    "uint32": "U32",
    "float32": "F32",
    "float64": "F64",
    "int64": "I64",
    "uint64": "U64",
}
TORCH_NAME_OF_CODE = {code: name for name, code in SAFETENSORS_DTYPES.items()}
SAFETENSORS_ORDER = {name: position for position, name in enumerate(SAFETENSORS_DTYPES)}


def dtype_of(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def is_floating(name: str) -> bool:
    """Whether the dtype `name` is a floating-point one (by its safetensors code, else torch's)."""
    code = SAFETENSORS_DTYPES.get(name)
    if code is None:
        return dtype_of(name).is_floating_point
    return code.startswith(("F", "BF"))


@functools.cache
def itemsize(name: str) -> int:
    """Bytes per element of the dtype `name`: the bits in its safetensors code (BOOL: one byte),
    or torch's own answer for a dtype safetensors has no code for."""
    code = SAFETENSORS_DTYPES.get(name)
    if code is None:
        return dtype_of(name).itemsize
    bits = "".join(character for character in code.split("_")[0] if character.isdigit())
    return int(bits) // 8 if bits else 1


def nbytes(shape, name: str) -> int:
    return math.prod(shape) * itemsize(name)
