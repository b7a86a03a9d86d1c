"""The conversion plan: every output tensor, where it comes from, what is applied.

A converter builds a :class:`Plan` from headers and configs only. ``validate``
then checks that it closes — every adapter tensor consumed, every LoRA op's
shapes fitting its target, no duplicate names — before the executor writes a
byte. The executor (converters.execute) walks the plan; it has no other input.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from . import errors as E
from .errors import InputError
from .io.dtypes import SAFETENSORS_DTYPES, itemsize
from .io.gguf_file import tensor_nbytes


@dataclass(frozen=True)
class Source:
    """Rows [r0, r1) of the 2-D view (leading dims flattened) of an input tensor."""

    file: str  # absolute path of the safetensors file
    tensor: str
    dtype: str
    r0: int
    r1: int
    cols: int

    @property
    def rows(self) -> int:
        return self.r1 - self.r0


@dataclass(frozen=True)
class LoraOp:
    """Add ``scale * B @ A`` to output rows [row_offset, row_offset + B.rows)."""

    a: Source  # r x in
    b: Source  # out x r
    scale: float
    row_offset: int
    module: str  # adapter module key, for reports


@dataclass(frozen=True)
class Transform:
    """A row transform applied after merging; blocks hold whole groups of ``unit`` rows."""

    kind: str  # "permute_qk": llama-style rotary rows of each head interleaved (GGUF layout)
    groups: int  # heads

    def unit(self, rows: int) -> int:
        return rows // self.groups


@dataclass(frozen=True)
class TensorPlan:
    name: str
    dtype: str  # output type: a safetensors dtype (BF16 …) or a ggml type (Q4_K …)
    shape: tuple[int, ...]
    sources: tuple[Source, ...]  # concatenated along rows (several for stacked experts)
    ops: tuple[LoraOp, ...] = ()
    round_to: str | None = None  # round merged values to this dtype first: the merged model's
    transform: Transform | None = None
    data: bytes | None = None  # a generated tensor, already encoded (e.g. rope factors)
    scale: float = 1.0  # multiply rows by this after merging (GGUF LoRA folds per-module scales into B)

    @property
    def source(self) -> Source:
        return self.sources[0]

    @property
    def nbytes(self) -> int:
        if self.dtype in SAFETENSORS_DTYPES:
            return math.prod(self.shape) * itemsize(self.dtype)
        return tensor_nbytes(self.dtype, self.shape)

    @property
    def verbatim(self) -> bool:
        """Copied byte-for-byte: one source, no LoRA op, no transform, no type change."""
        return self.data is None and len(self.sources) == 1 and not self.ops and self.transform is None and self.scale == 1.0 and self.dtype == self.source.dtype


@dataclass
class FilePlan:
    name: str  # relative path in the output
    tensors: list[TensorPlan]
    metadata: dict[str, str] | None = None  # safetensors __metadata__
    kind: str = "safetensors"  # or "gguf"
    kvs: list | None = None  # GGUF metadata (converters.io.gguf_file.KV)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass
class Plan:
    format: str
    files: list[FilePlan] = field(default_factory=list)
    generated: dict[str, bytes] = field(default_factory=dict)  # small files we write
    copied: list[tuple[Path, str]] = field(default_factory=list)  # byte-for-byte copies
    notes: list[str] = field(default_factory=list)

    @property
    def tensor_bytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    @property
    def total_bytes(self) -> int:
        return self.tensor_bytes + sum(len(b) for b in self.generated.values()) + sum(p.stat().st_size for p, _ in self.copied)

    def consumed(self) -> set[str]:
        used = set()
        for f in self.files:
            for t in f.tensors:
                used.update((src.file, src.tensor) for src in t.sources)
                for op in t.ops:
                    used.add((op.a.file, op.a.tensor))
                    used.add((op.b.file, op.b.tensor))
        return used

    def summary(self) -> dict:
        tensors = [t for f in self.files for t in f.tensors]
        return {
            "files": [f.name for f in self.files],
            "tensors": len(tensors),
            "tensors_with_lora": sum(1 for t in tensors if t.ops),
            "lora_ops": sum(len(t.ops) for t in tensors),
            "verbatim_tensors": sum(1 for t in tensors if t.verbatim),
            "tensor_bytes": self.tensor_bytes,
        }

    def validate(self, adapter_file: str | None = None, adapter_tensors: set[str] = frozenset()) -> None:
        """Refuse a plan that does not close. Raises InputError(plan_incomplete)."""
        names: set[str] = set()
        outputs = {f.name for f in self.files} | set(self.generated) | {n for _, n in self.copied}
        if len(outputs) != len(self.files) + len(self.generated) + len(self.copied):
            raise InputError(E.PLAN_INCOMPLETE, "the plan writes two output files with the same name.")
        for f in self.files:
            for t in f.tensors:
                if t.name in names:
                    raise InputError(E.PLAN_INCOMPLETE, f"the plan writes tensor {t.name} twice.")
                names.add(t.name)
                rows = math.prod(t.shape[:-1]) if len(t.shape) > 1 else 1
                cols = t.shape[-1] if t.shape else 1
                if t.data is not None:
                    continue
                src_rows = sum(src.rows for src in t.sources)
                if src_rows * t.source.cols != math.prod(t.shape) or ((t.ops or t.transform or len(t.sources) > 1) and (src_rows != rows or any(src.cols != cols for src in t.sources))):
                    raise InputError(E.ADAPTER_SHAPE_MISMATCH, f"{t.name}: sources {', '.join(f'{s.tensor}[{s.r0}:{s.r1}]' for s in t.sources)} do not fill shape {list(t.shape)}.")
                if t.transform is not None and rows % t.transform.groups:
                    raise InputError(E.BASE_INVALID, f"{t.name}: {rows} rows do not split into {t.transform.groups} heads; config.json disagrees with the weights.")
                for op in t.ops:
                    if op.a.cols != cols:
                        raise InputError(E.ADAPTER_SHAPE_MISMATCH, f"adapter module {op.module}: lora_A has {op.a.cols} input features but {t.name} has {cols}; the adapter was trained on a different base model.")
                    if op.b.cols != op.a.rows:
                        raise InputError(E.ADAPTER_SHAPE_MISMATCH, f"adapter module {op.module}: lora_B has {op.b.cols} columns but rank is {op.a.rows}.")
                    if op.row_offset < 0 or op.row_offset + op.b.rows > rows:
                        raise InputError(E.ADAPTER_SHAPE_MISMATCH, f"adapter module {op.module}: lora_B has {op.b.rows} output rows, which do not fit {t.name} {list(t.shape)}; the adapter was trained on a different base model.")
        if adapter_file is not None:
            used = {n for (f, n) in self.consumed() if f == adapter_file}
            left = sorted(adapter_tensors - used)
            if left:
                raise InputError(E.PLAN_INCOMPLETE, f"{len(left)} adapter tensor(s) would be silently dropped, e.g. {left[0]}; the adapter does not fit this base model or format.")


def shard(tensors: list[TensorPlan], max_bytes: int, stem: str = "model") -> list[FilePlan]:
    """Greedy sharding in plan order, named like transformers' save_pretrained."""
    groups: list[list[TensorPlan]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    if len(groups) == 1:
        return [FilePlan(f"{stem}.safetensors", groups[0], {"format": "pt"})]
    n = len(groups)
    return [FilePlan(f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors", g, {"format": "pt"}) for i, g in enumerate(groups)]


def index_json(files: list[FilePlan]) -> bytes:
    weight_map = {t.name: f.name for f in files for t in f.tensors}
    total = sum(f.nbytes for f in files)
    return (json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n").encode()


def parse_size(s: str | int) -> int:
    """'5GB', '500MB', '2GiB' or a byte count, as transformers accepts."""
    if isinstance(s, int):
        return s
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    t = s.strip().upper().replace(" ", "")
    num = t.rstrip("KMGTIB")
    unit = t[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1
    if unit not in units or value <= 0:
        raise InputError(E.INVALID_OPTION, f"size {s!r} is not valid; use a number with a unit such as 5GB or 500MB.", field="max_shard_size")
    return int(value * units[unit])
