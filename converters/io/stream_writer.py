"""Header-first streaming writer for tensor files (safetensors, GGUF).

The plan knows every tensor's name, type and shape before any data exists, so
the header (with final offsets) is written first and tensor bytes are streamed
after it in plan order. Nothing larger than a few row blocks is ever held.
Formats differ only in their header and in the alignment of tensor data
(GGUF pads every tensor to its alignment; safetensors packs them).

Writing and hashing run on a background thread (both release the GIL), so the
disk and sha256 work overlaps the merge arithmetic of the next block. (A
separate hashing thread was measured slower on two cores.) The queue is
bounded, which bounds memory: the producer waits when the disk lags.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import queue
import threading
from pathlib import Path
from typing import Callable

from .dtypes import itemsize

_QUEUE_BLOCKS = 4
_STOP = object()
_WRITEBACK_EVERY = 64 << 20


def _sync_file_range():
    """Linux sync_file_range(2), or None: starts writeback without waiting for it."""
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
        fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
        return fn
    except (OSError, AttributeError):
        return None


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


class StreamWriter:
    def __init__(self, path: str | os.PathLike, header: bytes, sizes: list[tuple[str, int]], *, align: int = 1, durable: bool = True):
        """``header`` is written first; then each tensor's ``sizes`` bytes, each
        followed by zero padding to ``align`` (the header must already end aligned).

        ``durable``: fsync on close, and start writeback while writing so that
        fsync has little left to do (the disk works while we compute)."""
        self.path = Path(path)
        self.durable = durable
        self._written = 0
        self._synced = 0
        self._align = align
        self._sizes = list(sizes)
        self.data_bytes = sum(n + (-n % align) for _, n in self._sizes)
        self.total_bytes = len(header) + self.data_bytes
        self._f = open(self.path, "xb")
        self._hash = hashlib.sha256()
        self._queue: queue.Queue = queue.Queue(maxsize=_QUEUE_BLOCKS)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, name=f"write-{self.path.name}", daemon=True)
        self._thread.start()
        self._put(header, None)
        self._index = 0
        self._left = self._sizes[0][1] if self._sizes else 0
        self._skip_empty()

    def _drain(self) -> None:
        # Never dies early: an error is recorded for the producer, and every
        # item's ``done`` still runs, so a producer waiting on the queue or on a
        # buffer handed back through ``done`` can never hang.
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            data, done = item
            try:
                if self._error is None:
                    self._f.write(data)
                    self._hash.update(data)
                    self._written += len(data)
                    if self.durable and _SYNC_FILE_RANGE and self._written - self._synced >= _WRITEBACK_EVERY:
                        self._f.flush()
                        _SYNC_FILE_RANGE(self._f.fileno(), self._synced, self._written - self._synced, _SYNC_FILE_RANGE_WRITE)
                        self._synced = self._written
            except BaseException as exc:
                self._error = exc
            finally:
                del data
                if done is not None:
                    try:
                        done()
                    except BaseException as exc:
                        self._error = self._error or exc

    def _put(self, data, done: Callable[[], None] | None) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put((data, done))

    def _skip_empty(self) -> None:
        # Called when the current tensor may be complete: pad it, move on.
        while self._left == 0 and self._index < len(self._sizes):
            pad = -self._sizes[self._index][1] % self._align
            if pad:
                self._put(bytes(pad), None)
            self._index += 1
            if self._index < len(self._sizes):
                self._left = self._sizes[self._index][1]

    @property
    def current(self) -> str | None:
        return self._sizes[self._index][0] if self._index < len(self._sizes) else None

    def write(self, data, done: Callable[[], None] | None = None) -> None:
        """Queue bytes of the current tensor (never across a tensor boundary).

        ``data`` must stay unchanged until written; ``done`` runs on the writer
        thread once it has been (to release the source buffer or mapping).
        """
        mv = memoryview(data)
        if mv.nbytes == 0:
            if done is not None:
                done()
            return
        mv = mv.cast("B")
        if len(mv) > self._left:
            raise RuntimeError(f"writer: {len(mv)} bytes for tensor {self.current!r} but only {self._left} remain")
        self._put(mv, done)
        self._left -= len(mv)
        self._skip_empty()

    def _finish_thread(self) -> None:
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()

    def close(self) -> str:
        """Finish the file (fsynced when durable); returns its sha256. Fails if any tensor is short."""
        self._finish_thread()
        try:
            if self._error is not None:
                raise self._error
            if self._index < len(self._sizes):
                raise RuntimeError(f"writer: tensor {self.current!r} is missing {self._left} bytes")
            self._f.flush()
            if self.durable:
                os.fsync(self._f.fileno())
        finally:
            self._f.close()
        return self._hash.hexdigest()

    def abort(self) -> None:
        self._finish_thread()
        self._f.close()


def safetensors_header(entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None) -> tuple[bytes, list[tuple[str, int]]]:
    """The safetensors header for tensors written in this order, and their byte sizes."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    sizes = []
    for name, dtype, shape in entries:
        n = math.prod(shape) * itemsize(dtype)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        sizes.append((name, n))
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data section starts 8-byte aligned
    return len(raw).to_bytes(8, "little") + raw, sizes


def SafetensorsWriter(path: str | os.PathLike, entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None, *, durable: bool = True) -> StreamWriter:
    header, sizes = safetensors_header(entries, metadata)
    return StreamWriter(path, header, sizes, durable=durable)
