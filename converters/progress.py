"""Progress reporting: the engine calls a callback; callers decide how to show it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class ProgressEvent:
    stage: str  # opening | planning | writing | verifying | done
    done: int  # bytes done in this stage
    total: int  # bytes in this stage (0 when unknown)
    message: str = ""


def silent(event: ProgressEvent) -> None:
    pass


ProgressFn = Callable[[ProgressEvent], None]
