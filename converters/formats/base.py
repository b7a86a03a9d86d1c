"""What a converter is, and the context it plans from."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from .. import errors as E
from ..adapter import Adapter
from ..errors import InputError
from ..io.dtypes import DTYPE_ALIASES
from ..archive import ArchiveLimits, Checkpoint
from ..base_model import BaseModel
from ..plan import Plan


@dataclass(frozen=True)
class ConvertOptions:
    """Options shared by every format; a format ignores what does not apply to it."""

    dtype: str | None = None  # safetensors dtype name (F32/BF16/F16); None keeps the input's
    max_shard_size: int = 5 * 10**9
    verify: bool | None = None  # None: on when the base model is small enough
    verify_max_params: int = 2_000_000_000
    force_base: bool = False
    overwrite: bool = False
    # fsync outputs before they are renamed into place, so a crash or power loss
    # never leaves a complete-looking but torn output. Off only for throwaway runs.
    durable: bool = True
    model_store: str | None = None
    base_revision: str | None = None
    offline: bool | None = None
    # False where the base model's name comes from a user of the service: Hub ids only, no local paths
    allow_local_base: bool = True
    # the manifest leaves out where and when (output and input paths, creation time), so one
    # export is byte-identical wherever and whenever it runs (the job runner's resumed attempts)
    reproducible: bool = False
    limits: ArchiveLimits = field(default_factory=ArchiveLimits)
    # GGUF
    quant: str = "f16"
    split_max_size: int | None = None
    allow_unknown_pretokenizer: bool = False

    def __post_init__(self) -> None:
        # Accept the user-facing spellings (bf16, float16, …) from Python callers too.
        if self.dtype is not None:
            key = str(self.dtype).strip()
            canonical = DTYPE_ALIASES.get(key.lower(), key if key in DTYPE_ALIASES.values() else None)
            if canonical is None:
                raise InputError(E.INVALID_OPTION, f"dtype {self.dtype!r} is not valid; use bf16, fp16 or fp32.", field="dtype")
            object.__setattr__(self, "dtype", canonical)
        from ..gguf_quant import quant_type

        object.__setattr__(self, "quant", quant_type(self.quant).name)
        if self.max_shard_size <= 0:
            raise InputError(E.INVALID_OPTION, "max_shard_size must be positive.", field="max_shard_size")


@dataclass
class ConvertContext:
    checkpoint: Checkpoint | None
    adapter: Adapter | None
    base: BaseModel
    options: ConvertOptions

    def readers(self) -> dict:
        r = {str(self.base.path / n): f for n, f in self.base.files.items()}
        if self.adapter is not None:
            r[str(self.adapter.path)] = self.adapter.file
        return r


class Converter(ABC):
    name: str = ""
    needs_adapter: bool = True
    description: str = ""

    @abstractmethod
    def plan(self, ctx: ConvertContext) -> Plan:
        """Build the full plan from headers and configs only; no output I/O."""

    def report(self, ctx: ConvertContext, plan: Plan) -> dict:
        """Extra manifest sections (e.g. a compatibility report)."""
        return {}

    def verify(self, ctx: ConvertContext, out_dir) -> dict:
        """Check the written output against a reference; returns a report."""
        from ..verify import verify_output

        return verify_output(self.name, ctx, out_dir)
