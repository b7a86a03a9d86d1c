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
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .io.dtypes import to_torch
from .io.safetensors_reader import SafetensorsFile
from .io.safetensors_writer import SafetensorsWriter
from .plan import Plan, TensorPlan
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
        w.write(r.raw(off, stop))
        r.release(off, stop)
        rep.add(stop - off)


def _merge_blocks(t: TensorPlan, readers: dict[str, SafetensorsFile], w: SafetensorsWriter, rep: _Reporter) -> None:
    src = t.source
    r = readers[src.file]
    info = r.tensors[src.tensor]
    out_dtype = to_torch(t.dtype)
    ops = [
        (op, readers[op.a.file].rows(op.a.tensor, op.a.r0, op.a.r1).to(torch.float32),
         readers[op.b.file].rows(op.b.tensor, op.b.r0, op.b.r1).to(torch.float32))
        for op in t.ops
    ]
    cols = src.cols
    block = max(1, BLOCK_BYTES // max(1, cols * 4))
    buf = torch.empty(min(block, src.rows) * cols, dtype=torch.float32)
    for r0 in range(0, src.rows, block):
        r1 = min(src.rows, r0 + block)
        x = buf[: (r1 - r0) * cols].view(r1 - r0, cols)
        x.copy_(r.rows(src.tensor, src.r0 + r0, src.r0 + r1))
        for op, a, b in ops:
            lo, hi = max(r0, op.row_offset), min(r1, op.row_offset + b.shape[0])
            if lo < hi:
                # fp32 accumulate: x += scale * B[rows] @ A
                x[lo - r0 : hi - r0].addmm_(b[lo - op.row_offset : hi - op.row_offset], a, alpha=op.scale)
        y = x if out_dtype == torch.float32 else x.to(out_dtype)
        w.write(y.view(torch.uint8).numpy())
        r.release(info.start + (src.r0 + r0) * info.row_bytes, info.start + (src.r0 + r1) * info.row_bytes)
        rep.add((r1 - r0) * cols * y.element_size())


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


def execute(plan: Plan, out_dir: Path, readers: dict[str, SafetensorsFile], progress: ProgressFn = silent) -> dict[str, FileRecord]:
    """Write everything the plan names into ``out_dir`` (which must exist and be empty)."""
    rep = _Reporter(progress, plan.total_bytes)
    records: dict[str, FileRecord] = {}
    with torch.inference_mode():
        for fp in plan.files:
            path = out_dir / fp.name
            path.parent.mkdir(parents=True, exist_ok=True)
            w = SafetensorsWriter(path, [(t.name, t.dtype, t.shape) for t in fp.tensors], fp.metadata)
            try:
                for t in fp.tensors:
                    if t.verbatim:
                        _copy_verbatim(t, readers[t.source.file], w, rep)
                    else:
                        _merge_blocks(t, readers, w, rep)
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


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
