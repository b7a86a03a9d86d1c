"""ggml's own quantizer, called through ctypes from the libggml that llama-cpp-python ships.

Using ggml's code (not a re-implementation) makes our quantized blocks
byte-identical to what llama.cpp's tools write. ctypes releases the GIL during
the call, so several threads quantize row chunks of a tensor in parallel.
"""

from __future__ import annotations

import ctypes
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from . import errors as E
from .errors import ExportError
from .io.gguf_file import ggml_type, row_bytes


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL:
    try:
        import llama_cpp
    except ImportError:
        raise ExportError(E.INVALID_OPTION, "quantized GGUF output needs llama-cpp-python (pip install 'nucleus-export[gguf]'); f32, f16 and bf16 work without it.") from None
    libdir = Path(llama_cpp.__file__).parent / "lib"
    for name in ("libggml-base.so", "libggml.so", "libggml-base.dylib", "ggml-base.dll"):
        if (libdir / name).exists():
            lib = ctypes.CDLL(str(libdir / name))
            break
    else:
        raise ExportError(E.INTERNAL, f"llama-cpp-python is installed but its libggml was not found in {libdir}.")
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p)
    lib.ggml_quantize_init.argtypes = (ctypes.c_int,)
    lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    lib.ggml_quantize_requires_imatrix.argtypes = (ctypes.c_int,)
    return lib


def available() -> bool:
    try:
        _lib()
        return True
    except ExportError:
        return False


@functools.lru_cache(maxsize=1)
def _pool() -> ThreadPoolExecutor:
    # one long-lived pool: starting threads per block cost more than quantizing small blocks
    return ThreadPoolExecutor(_threads(), thread_name_prefix="ggml-quantize")


def _threads() -> int:
    # Every core: quantized output is small, so the writer thread is mostly idle
    # while ggml quantizes (measured: 2 threads ~1.9x faster than 1 on 2 cores).
    return max(1, len(os.sched_getaffinity(0)))


@functools.lru_cache(maxsize=None)
def _prepared(type_name: str) -> int:
    """The ggml type id, checked and initialised once per type (not per block)."""
    lib = _lib()
    t = int(ggml_type(type_name))
    if lib.ggml_quantize_requires_imatrix(t):
        raise ExportError(E.INVALID_OPTION, f"{type_name} needs an importance matrix, which this exporter does not compute; choose a K-quant mix instead.")
    lib.ggml_quantize_init(t)
    return t


def quantize_rows(type_name: str, rows: np.ndarray, out: np.ndarray) -> int:
    """Quantize a C-contiguous float32 [n, cols] array into ``out`` (uint8); returns bytes written."""
    lib = _lib()
    t = _prepared(type_name)
    n, cols = rows.shape
    rb = row_bytes(type_name, cols)
    assert rows.dtype == np.float32 and rows.flags.c_contiguous and out.nbytes >= n * rb
    nthreads = min(_threads(), max(1, n // 8))
    chunks = [(i * n // nthreads, (i + 1) * n // nthreads) for i in range(nthreads)]

    def run(span: tuple[int, int]) -> int:
        a, b = span
        if a == b:
            return 0
        src = rows[a:b].ctypes.data
        dst = out.ctypes.data + a * rb
        return lib.ggml_quantize_chunk(t, ctypes.c_void_p(src), ctypes.c_void_p(dst), 0, b - a, cols, None)

    if nthreads == 1:
        return run(chunks[0])
    return sum(_pool().map(run, chunks))
