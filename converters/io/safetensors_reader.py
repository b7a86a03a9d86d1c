"""Validated, memory-mapped safetensors reading.

The header is parsed and checked by us before any tensor is touched (size cap,
JSON shape, known dtypes, offsets inside the file and consistent with the
shape, no overlaps), so a hostile file fails with a precise error code instead
of a crash deep inside a library. Tensor data is read as row blocks from a
private mapping; ``release`` drops pages we are done with so the resident set
stays small while streaming a large model.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import errors as E
from ..errors import InputError
from .dtypes import SAFETENSORS_DTYPES, itemsize, to_torch

DEFAULT_MAX_HEADER_BYTES = 100 * 1024 * 1024
_PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    # The engine sees every tensor as 2-D: leading dimensions flattened into
    # rows, the last dimension as columns. A fused expert tensor [E, out, in]
    # is then E*out rows of `in` columns, and expert e's block starts at row e*out.
    @property
    def cols(self) -> int:
        return self.shape[-1] if self.shape else 1

    @property
    def rows(self) -> int:
        return self.numel // self.cols if self.cols else 0

    @property
    def row_bytes(self) -> int:
        return self.cols * itemsize(self.dtype)


def read_header(path: str | os.PathLike, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate a safetensors header. Returns (tensors, metadata)."""
    path = Path(path)
    name = path.name
    file_size = path.stat().st_size
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise InputError(E.SAFETENSORS_BAD_HEADER, f"{name} is too short to be a safetensors file; re-export it with safetensors.")
        (hlen,) = struct.unpack("<Q", raw_len)
        if hlen > max_header_bytes:
            raise InputError(E.SAFETENSORS_HEADER_TOO_LARGE, f"{name} declares a {hlen}-byte header, over the {max_header_bytes}-byte cap; the file is corrupt or hostile.")
        if 8 + hlen > file_size:
            raise InputError(E.SAFETENSORS_BAD_HEADER, f"{name} declares a header longer than the file; the file is truncated.")
        raw = f.read(hlen)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(E.SAFETENSORS_BAD_HEADER, f"{name} has a header that is not valid JSON ({exc.__class__.__name__}); the file is corrupt.") from None
    if not isinstance(header, dict):
        raise InputError(E.SAFETENSORS_BAD_HEADER, f"{name} has a header that is not a JSON object; the file is corrupt.")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise InputError(E.SAFETENSORS_BAD_HEADER, f"{name} has __metadata__ that is not a string-to-string map.")
    data_start = 8 + hlen
    data_len = file_size - data_start
    tensors: dict[str, TensorInfo] = {}
    for tname, entry in header.items():
        if not isinstance(entry, dict) or set(entry) - {"dtype", "shape", "data_offsets"} or len(entry) != 3:
            raise InputError(E.SAFETENSORS_BAD_HEADER, f"{name}: entry for tensor {tname!r} must have exactly dtype, shape and data_offsets.")
        dtype, shape, offs = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in SAFETENSORS_DTYPES:
            raise InputError(E.SAFETENSORS_UNKNOWN_DTYPE, f"{name}: tensor {tname!r} has unknown dtype {dtype!r}; supported: {', '.join(SAFETENSORS_DTYPES)}.")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise InputError(E.SAFETENSORS_BAD_HEADER, f"{name}: tensor {tname!r} has an invalid shape {shape!r}.")
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) and not isinstance(o, bool) for o in offs)):
            raise InputError(E.SAFETENSORS_BAD_HEADER, f"{name}: tensor {tname!r} has invalid data_offsets {offs!r}.")
        b, e = offs
        if not (0 <= b <= e <= data_len):
            raise InputError(E.SAFETENSORS_OFFSETS_OUT_OF_RANGE, f"{name}: tensor {tname!r} points at bytes {b}..{e}, outside the {data_len}-byte data section; the file is truncated or corrupt.")
        expected = math.prod(shape) * itemsize(dtype)
        if e - b != expected:
            raise InputError(E.SAFETENSORS_OFFSETS_OUT_OF_RANGE, f"{name}: tensor {tname!r} spans {e - b} bytes but its shape {shape} and dtype {dtype} need {expected}.")
        tensors[tname] = TensorInfo(tname, dtype, tuple(shape), data_start + b, data_start + e)
    spans = sorted((t.start, t.end, t.name) for t in tensors.values() if t.end > t.start)
    for (b0, e0, n0), (b1, _e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise InputError(E.SAFETENSORS_OVERLAP, f"{name}: tensors {n0!r} and {n1!r} share bytes; the file is corrupt or hostile.")
    return tensors, metadata


class SafetensorsFile:
    """One validated safetensors file, mapped read-only (private mapping)."""

    def __init__(self, path: str | os.PathLike, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES):
        self.path = Path(path)
        self.tensors, self.metadata = read_header(self.path, max_header_bytes)
        self._fd: int | None = None
        self._mm: mmap.mmap | None = None

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _map(self) -> mmap.mmap:
        if self._mm is None:
            self._fd = os.open(self.path, os.O_RDONLY)
            size = os.fstat(self._fd).st_size
            # ACCESS_COPY gives a writable private view, which torch.frombuffer
            # wants; we never write, so pages stay backed by the file.
            self._mm = mmap.mmap(self._fd, size, access=mmap.ACCESS_COPY) if size else None
        return self._mm

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def raw(self, start: int, end: int) -> memoryview:
        """Absolute byte range of the file, zero-copy."""
        return memoryview(self._map())[start:end]

    def rows(self, name: str, r0: int, r1: int) -> torch.Tensor:
        """Rows r0:r1 of the tensor's 2-D view, in its own dtype (zero-copy)."""
        info = self.tensors[name]
        count = (r1 - r0) * info.cols
        if count == 0:
            return torch.empty((r1 - r0, info.cols), dtype=to_torch(info.dtype))
        t = torch.frombuffer(self._map(), dtype=to_torch(info.dtype), count=count, offset=info.start + r0 * info.row_bytes)
        return t.view(r1 - r0, info.cols)

    def read_rows(self, name: str, r0: int, r1: int, out: torch.Tensor) -> torch.Tensor:
        """Copy rows r0:r1 into ``out`` (a buffer of the tensor's dtype) with pread.

        Used on the hot path instead of the mapping: no page faults, and file
        pages never enter our resident set.
        """
        info = self.tensors[name]
        n = (r1 - r0) * info.cols
        view = out.view(-1)[:n]
        buf = view.view(torch.uint8).numpy()
        if self._fd is None:
            self._map()
        got = os.preadv(self._fd, [buf], info.start + r0 * info.row_bytes)
        if got != buf.nbytes:
            raise OSError(f"short read from {self.path.name}: the file changed or was truncated while converting")
        return view.view(r1 - r0, info.cols)

    def rows_copy(self, name: str, r0: int, r1: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows r0:r1 copied out as ``dtype``; their mapped pages are released after."""
        info = self.tensors[name]
        out = self.rows(name, r0, r1).to(dtype, copy=True)
        self.release(info.start + r0 * info.row_bytes, info.start + r1 * info.row_bytes)
        return out

    def tensor(self, name: str) -> torch.Tensor:
        """A full tensor, copied out of the mapping (for small tensors such as adapters)."""
        info = self.tensors[name]
        return self.rows(name, 0, info.rows).clone().reshape(info.shape)

    def release(self, start: int, end: int) -> None:
        """Drop mapped pages in [start, end) from the resident set."""
        if self._mm is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        a = (start // _PAGE) * _PAGE
        b = min(len(self._mm), -(-end // _PAGE) * _PAGE)
        if b > a:
            self._mm.madvise(mmap.MADV_DONTNEED, a, b - a)
