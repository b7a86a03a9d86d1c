"""safetensors dtype names, their sizes and torch equivalents (one table)."""

from __future__ import annotations

import torch

# name -> (itemsize in bytes, torch dtype or None where torch has no equivalent)
SAFETENSORS_DTYPES: dict[str, tuple[int, torch.dtype | None]] = {
    "BOOL": (1, torch.bool),
    "U8": (1, torch.uint8),
    "I8": (1, torch.int8),
    "I16": (2, torch.int16),
    "U16": (2, getattr(torch, "uint16", None)),
    "F16": (2, torch.float16),
    "BF16": (2, torch.bfloat16),
    "I32": (4, torch.int32),
    "U32": (4, getattr(torch, "uint32", None)),
    "F32": (4, torch.float32),
    "F64": (8, torch.float64),
    "I64": (8, torch.int64),
    "U64": (8, getattr(torch, "uint64", None)),
    "F8_E4M3": (1, getattr(torch, "float8_e4m3fn", None)),
    "F8_E5M2": (1, getattr(torch, "float8_e5m2", None)),
}

FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}

_BY_TORCH = {v[1]: k for k, v in SAFETENSORS_DTYPES.items() if v[1] is not None}

# user-facing names accepted by --dtype
DTYPE_ALIASES = {
    "bf16": "BF16", "bfloat16": "BF16",
    "fp16": "F16", "f16": "F16", "float16": "F16", "half": "F16",
    "fp32": "F32", "f32": "F32", "float32": "F32", "float": "F32",
}


def itemsize(dtype: str) -> int:
    return SAFETENSORS_DTYPES[dtype][0]


def to_torch(dtype: str) -> torch.dtype:
    t = SAFETENSORS_DTYPES[dtype][1]
    if t is None:
        raise TypeError(f"torch has no dtype for safetensors {dtype}")
    return t


def from_torch(dtype: torch.dtype) -> str:
    return _BY_TORCH[dtype]


def torch_name(dtype: str) -> str:
    """The name transformers writes in config.json's dtype field."""
    return str(to_torch(dtype)).removeprefix("torch.")
