"""GGUF v3 headers: metadata key/values and tensor infos, serialised for streaming.

gguf-py supplies the format's constants (value types, ggml types and their
block sizes); the bytes are laid out here so the header can be written before
any tensor data exists and the data streamed after it (converters.io.stream_writer).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = 0x46554747  # "GGUF"
GGUF_VERSION = 3
ALIGNMENT = 32

_SCALAR = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_NUMPY = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2", GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4", GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}


@dataclass(frozen=True)
class KV:
    key: str
    type: GGUFValueType
    value: Any
    sub_type: GGUFValueType | None = None  # element type of an ARRAY


def kv_string(key: str, v: str) -> KV:
    return KV(key, GGUFValueType.STRING, v)


def kv_u32(key: str, v: int) -> KV:
    return KV(key, GGUFValueType.UINT32, int(v))


def kv_i32(key: str, v: int) -> KV:
    return KV(key, GGUFValueType.INT32, int(v))


def kv_f32(key: str, v: float) -> KV:
    return KV(key, GGUFValueType.FLOAT32, float(v))


def kv_bool(key: str, v: bool) -> KV:
    return KV(key, GGUFValueType.BOOL, bool(v))


def kv_array(key: str, values, sub_type: GGUFValueType) -> KV:
    return KV(key, GGUFValueType.ARRAY, values, sub_type)


def _string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _value(t: GGUFValueType, v, sub: GGUFValueType | None) -> bytes:
    if t == GGUFValueType.STRING:
        return _string(v)
    if t == GGUFValueType.ARRAY:
        head = struct.pack("<IQ", int(sub), len(v))
        if sub == GGUFValueType.STRING:
            return head + b"".join(_string(x) for x in v)
        return head + np.asarray(v, dtype=_NUMPY[sub]).tobytes()
    return struct.pack(_SCALAR[t], v)


def ggml_type(name: str) -> GGMLQuantizationType:
    return GGMLQuantizationType[name]


def tensor_nbytes(type_name: str, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of numpy-order ``shape`` stored as ggml type ``type_name``."""
    block, size = GGML_QUANT_SIZES[ggml_type(type_name)]
    cols = shape[-1] if shape else 1
    if cols % block:
        raise ValueError(f"{type_name} needs rows that are a multiple of {block}, got {cols}")
    return math.prod(shape[:-1]) * (cols // block) * size


def row_bytes(type_name: str, cols: int) -> int:
    block, size = GGML_QUANT_SIZES[ggml_type(type_name)]
    return (cols // block) * size


def gguf_header(kvs: list[KV], tensors: list[tuple[str, str, tuple[int, ...]]], alignment: int = ALIGNMENT) -> tuple[bytes, list[tuple[str, int]]]:
    """(header bytes padded to ``alignment``, [(tensor name, data bytes)]) for tensors in write order.

    ``tensors`` are (name, ggml type name, numpy-order shape); GGUF stores the
    dimensions innermost first, so they are reversed here.
    """
    out = [struct.pack("<IIQQ", GGUF_MAGIC, GGUF_VERSION, len(tensors), len(kvs))]
    for kv in kvs:
        out.append(_string(kv.key) + struct.pack("<I", int(kv.type)) + _value(kv.type, kv.value, kv.sub_type))
    offset = 0
    sizes = []
    for name, type_name, shape in tensors:
        dims = tuple(reversed(shape)) or (1,)
        out.append(_string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", int(ggml_type(type_name)), offset))
        n = tensor_nbytes(type_name, shape)
        sizes.append((name, n))
        offset += n + (-n % alignment)
    raw = b"".join(out)
    return raw + bytes(-len(raw) % alignment), sizes
