"""The one execute loop: walk a validated plan and write every output file.

Formats differ in the plans they build, never here. Tensors are streamed in
row blocks: verbatim tensors are copied from the mapped input in chunks; the
others are widened to fp32, get their LoRA deltas added (``addmm_`` on the
block's rows, so B@A is never materialised for a whole tensor), and are
rounded once to the output dtype. Mapped input pages are released as soon as a
block is written, so resident memory stays near one block, not one shard.
"""

from __future__ import annotations

import hashlib
import os
import queue
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import ggml
from .io.dtypes import SAFETENSORS_DTYPES, to_torch
from .io.gguf_file import ALIGNMENT, gguf_header
from .io.safetensors_reader import SafetensorsFile
from .io.stream_writer import SafetensorsWriter, StreamWriter
from .transforms import TRANSFORMS
from .plan import FilePlan, Plan, TensorPlan
from .progress import ProgressEvent, ProgressFn, silent

BLOCK_BYTES = 16 << 20  # fp32 working set of one row block
COPY_CHUNK = 16 << 20


@dataclass(frozen=True)
class FileRecord:
    name: str
    size: int
    sha256: str


class _Reporter:
    def __init__(self, progress: ProgressFn, total: int):
        self.progress, self.total, self.done = progress, total, 0
        self._last = 0.0

    def add(self, n: int, force: bool = False) -> None:
        self.done += n
        now = time.monotonic()
        if force or now - self._last >= 0.1:
            self._last = now
            self.progress(ProgressEvent("writing", self.done, self.total))


def _copy_verbatim(t: TensorPlan, r: SafetensorsFile, w: SafetensorsWriter, rep: _Reporter) -> None:
    info = r.tensors[t.source.tensor]
    start = info.start + t.source.r0 * info.row_bytes
    end = info.start + t.source.r1 * info.row_bytes
    for off in range(start, end, COPY_CHUNK):
        stop = min(end, off + COPY_CHUNK)
        w.write(r.raw(off, stop), done=lambda a=off, b=stop: r.release(a, b))
        rep.add(stop - off)


class _Buffers:
    """Fixed working memory for the block loop: nothing is allocated per block.

    ``src`` and ``acc`` are used by the compute thread only; ``out`` buffers go
    to the writer thread and come back through the write's ``done`` callback,
    which also throttles the producer when the disk lags.
    """

    def __init__(self, nbytes: int = BLOCK_BYTES, out_buffers: int = 6):
        self.nbytes = nbytes
        self.src = torch.empty(nbytes, dtype=torch.uint8)
        self.acc = torch.empty(nbytes // 4, dtype=torch.float32)
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(out_buffers):
            self._free.put(torch.empty(nbytes, dtype=torch.uint8))

    def take(self) -> torch.Tensor:
        return self._free.get()

    def give(self, t: torch.Tensor) -> None:
        self._free.put(t)


def _encode(x: torch.Tensor, dtype: str, out: torch.Tensor) -> torch.Tensor:
    """Write fp32 rows ``x`` as ``dtype`` into ``out``; returns the bytes written (a view)."""
    if dtype in SAFETENSORS_DTYPES:
        y = out.view(to_torch(dtype))[: x.numel()].view(x.shape)
        y.copy_(x)  # the single rounding to the output dtype
        return y.view(-1).view(torch.uint8)
    n = ggml.quantize_rows(dtype, x.numpy(), out.numpy())
    return out[:n]


def _block_rows(t: TensorPlan, cols: int) -> int:
    rows = max(1, BLOCK_BYTES // max(1, cols * 4))
    if t.transform is not None:  # whole heads per block
        unit = t.transform.unit(sum(s.rows for s in t.sources))
        rows = max(unit, rows // unit * unit)
    return rows


def _stream_blocks(t: TensorPlan, readers: dict[str, SafetensorsFile], w: StreamWriter, rep: _Reporter, bufs: _Buffers) -> None:
    """Merge, round, transform and encode one tensor block by block, in output row order."""
    ops = [
        (op, readers[op.a.file].rows_copy(op.a.tensor, op.a.r0, op.a.r1, torch.float32),
         readers[op.b.file].rows_copy(op.b.tensor, op.b.r0, op.b.r1, torch.float32))
        for op in t.ops
    ]
    cols = t.source.cols
    block = _block_rows(t, cols)
    if block * cols * 4 > bufs.nbytes:  # one block wider than the pool: size the buffers for it
        bufs = _Buffers(block * cols * 4, out_buffers=2)
    round_to = to_torch(t.round_to) if t.round_to and t.round_to != "F32" else None
    transform = TRANSFORMS[t.transform.kind] if t.transform else None
    unit = t.transform.unit(sum(s.rows for s in t.sources)) if t.transform else 0
    out_row = 0
    for src in t.sources:
        r = readers[src.file]
        src_view = bufs.src.view(to_torch(src.dtype))
        for r0 in range(0, src.rows, block):
            r1 = min(src.rows, r0 + block)
            lo_out, n = out_row + r0, (r1 - r0) * cols
            x = bufs.acc[:n].view(r1 - r0, cols)
            x.copy_(r.read_rows(src.tensor, src.r0 + r0, src.r0 + r1, src_view))
            for op, a, b in ops:
                lo, hi = max(lo_out, op.row_offset), min(lo_out + r1 - r0, op.row_offset + b.shape[0])
                if lo < hi:
                    # fp32 accumulate: x += scale * B[rows] @ A
                    x[lo - lo_out : hi - lo_out].addmm_(b[lo - op.row_offset : hi - op.row_offset], a, alpha=op.scale)
            if t.scale != 1.0:
                x.mul_(t.scale)
            if round_to is not None:
                x.copy_(x.to(round_to))
            if transform is not None:
                x = transform(x, unit).contiguous()
            out = bufs.take()
            data = _encode(x, t.dtype, out)
            w.write(data.numpy(), done=lambda o=out: bufs.give(o))
            rep.add(data.numel())
        out_row += src.rows


def _copy_file(src: Path, dst: Path, name: str, rep: _Reporter) -> FileRecord:
    h = hashlib.sha256()
    size = 0
    with open(src, "rb") as fi, open(dst, "xb") as fo:
        while b := fi.read(COPY_CHUNK):
            fo.write(b)
            h.update(b)
            size += len(b)
            rep.add(len(b))
    shutil.copystat(src, dst, follow_symlinks=False)
    return FileRecord(name, size, h.hexdigest())


def execute(plan: Plan, out_dir: Path, readers: dict[str, SafetensorsFile], progress: ProgressFn = silent, durable: bool = True) -> dict[str, FileRecord]:
    """Write everything the plan names into ``out_dir`` (which must exist and be empty)."""
    rep = _Reporter(progress, plan.total_bytes)
    records: dict[str, FileRecord] = {}
    threads = torch.get_num_threads()
    # Leave a core to the writer thread (write + sha256): on small machines
    # torch's own threads would otherwise fight it (measured slower).
    torch.set_num_threads(max(1, min(threads, len(os.sched_getaffinity(0)) - 1)))
    try:
        return _execute(plan, out_dir, readers, rep, records, durable)
    finally:
        torch.set_num_threads(threads)


def _execute(plan: Plan, out_dir: Path, readers: dict[str, SafetensorsFile], rep: "_Reporter", records: dict[str, FileRecord], durable: bool) -> dict[str, FileRecord]:
    bufs = _Buffers()
    with torch.inference_mode():
        for fp in plan.files:
            path = out_dir / fp.name
            path.parent.mkdir(parents=True, exist_ok=True)
            w = _open_writer(fp, path, durable)
            try:
                for t in fp.tensors:
                    if t.data is not None:
                        w.write(t.data)
                        rep.add(len(t.data))
                    elif t.verbatim:
                        _copy_verbatim(t, readers[t.source.file], w, rep)
                    else:
                        _stream_blocks(t, readers, w, rep, bufs)
                sha = w.close()
            except BaseException:
                w.abort()
                raise
            records[fp.name] = FileRecord(fp.name, w.total_bytes, sha)
    for name, data in plan.generated.items():
        path = out_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "xb") as f:
            f.write(data)
        records[name] = FileRecord(name, len(data), hashlib.sha256(data).hexdigest())
        rep.add(len(data))
    for src, name in plan.copied:
        path = out_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        records[name] = _copy_file(src, path, name, rep)
    rep.add(0, force=True)
    return records


def _open_writer(fp: FilePlan, path: Path, durable: bool) -> StreamWriter:
    entries = [(t.name, t.dtype, t.shape) for t in fp.tensors]
    if fp.kind == "gguf":
        header, sizes = gguf_header(fp.kvs or [], entries)
        return StreamWriter(path, header, sizes, align=ALIGNMENT, durable=durable)
    return SafetensorsWriter(path, entries, fp.metadata, durable=durable)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
