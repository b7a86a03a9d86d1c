"""What a converter is, and the context it plans from."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from ..adapter import Adapter
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
    model_store: str | None = None
    base_revision: str | None = None
    offline: bool | None = None
    limits: ArchiveLimits = field(default_factory=ArchiveLimits)


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
