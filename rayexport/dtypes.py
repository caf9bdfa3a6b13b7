"""Dtype names shared by every stage: torch's names, and safetensors' codes in its own order."""

from __future__ import annotations

import math

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
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def itemsize(name: str) -> int:
    return dtype_of(name).itemsize


def nbytes(shape, name: str) -> int:
    return math.prod(shape) * itemsize(name)
