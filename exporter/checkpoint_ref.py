"""Checkpoint names: ``nucleus://run_3Bz:train:0/sampler_weights/000240`` and plain ids.

The URI's authority is the run (``run_3Bz``), optionally followed by the
trainer's role and index (``:train:0``); the path is the checkpoint id within
the run (``sampler_weights/000240``). Anywhere a checkpoint is named, the URI
is accepted in place of a run id plus checkpoint id.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from converters import errors as E
from converters.errors import ExportError

_SEG = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}"
URI = re.compile(rf"nucleus://(?P<run>{_SEG})(?::(?P<role>[A-Za-z0-9_-]+):(?P<index>\d+))?/(?P<path>{_SEG}(?:/{_SEG})*)")
ID = re.compile(rf"{_SEG}(?:/{_SEG})*")


@dataclass(frozen=True)
class CheckpointRef:
    run_id: str
    checkpoint_id: str
    role: str | None = None
    index: int | None = None


def parse(uri: str) -> CheckpointRef:
    m = URI.fullmatch(uri or "")
    if not m:
        raise ExportError(E.VALIDATION_FAILED, f"{uri!r} is not a checkpoint URI; write it like nucleus://run_3Bz:train:0/sampler_weights/000240.", field="checkpoint")
    return CheckpointRef(m["run"], m["path"], m["role"], int(m["index"]) if m["index"] else None)


def validate_run(run_id: str) -> str:
    if not re.fullmatch(_SEG, run_id):
        raise ExportError(E.VALIDATION_FAILED, f"run id {run_id!r} is not valid (letters, digits, '_', '.', '-').", field="run_id")
    return run_id


def resolve(run_id: str, checkpoint_id: str) -> CheckpointRef:
    """A route's (run, checkpoint) pair, where the checkpoint may be given as a full URI."""
    if checkpoint_id.startswith("nucleus://"):
        ref = parse(checkpoint_id)
        if ref.run_id != run_id:
            raise ExportError(E.VALIDATION_FAILED, f"checkpoint {checkpoint_id} belongs to run {ref.run_id}, not {run_id}.", field="checkpoint_id")
        return ref
    validate_run(run_id)
    if not ID.fullmatch(checkpoint_id):
        raise ExportError(E.VALIDATION_FAILED, f"checkpoint id {checkpoint_id!r} is not valid (like 000240 or sampler_weights/000240).", field="checkpoint_id")
    return CheckpointRef(run_id, checkpoint_id)
