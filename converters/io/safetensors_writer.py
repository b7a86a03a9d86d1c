"""Header-first streaming safetensors writer.

The plan knows every tensor's name, dtype and shape before any data exists, so
the header (with final offsets) is written first and tensor bytes are streamed
after it in plan order. Nothing larger than one row block is ever held. The
sha256 of the file is computed on the fly.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

from .dtypes import itemsize


class SafetensorsWriter:
    def __init__(self, path: str | os.PathLike, entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None):
        self.path = Path(path)
        header: dict = {}
        if metadata:
            header["__metadata__"] = metadata
        offset = 0
        self._sizes: list[tuple[str, int]] = []
        for name, dtype, shape in entries:
            n = math.prod(shape) * itemsize(dtype)
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
            self._sizes.append((name, n))
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data section starts 8-byte aligned
        self.data_bytes = offset
        self.total_bytes = 8 + len(raw) + offset
        self._f = open(self.path, "xb")
        self._hash = hashlib.sha256()
        self._emit(len(raw).to_bytes(8, "little"))
        self._emit(raw)
        self._index = 0
        self._left = self._sizes[0][1] if self._sizes else 0
        self._skip_empty()

    def _emit(self, b) -> None:
        self._f.write(b)
        self._hash.update(b)

    def _skip_empty(self) -> None:
        while self._left == 0 and self._index < len(self._sizes):
            self._index += 1
            if self._index < len(self._sizes):
                self._left = self._sizes[self._index][1]

    @property
    def current(self) -> str | None:
        return self._sizes[self._index][0] if self._index < len(self._sizes) else None

    def write(self, data) -> None:
        """Append bytes of the current tensor (never across a tensor boundary)."""
        mv = memoryview(data)
        if mv.nbytes == 0:
            return
        mv = mv.cast("B")
        if len(mv) > self._left:
            raise RuntimeError(f"writer: {len(mv)} bytes for tensor {self.current!r} but only {self._left} remain")
        self._emit(mv)
        self._left -= len(mv)
        self._skip_empty()

    def close(self) -> str:
        """Finish the file; returns its sha256. Fails if any tensor is short."""
        if self._index < len(self._sizes):
            self._f.close()
            raise RuntimeError(f"writer: tensor {self.current!r} is missing {self._left} bytes")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return self._hash.hexdigest()

    def abort(self) -> None:
        self._f.close()
