"""nucleus-export.json: what an output is, where it came from, and its checksums."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

MANIFEST_NAME = "nucleus-export.json"
SCHEMA_VERSION = 1


def tool_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nucleus-export")
    except PackageNotFoundError:
        return "0+unknown"


@dataclass
class OutputManifest:
    format: str
    path: str | None  # None in a reproducible manifest
    files: list[dict]  # {name, size, sha256}
    source: dict  # archive path, sha256, run/checkpoint ids
    base_model: dict  # id, revision, path, architecture
    options: dict
    plan: dict
    verification: dict | None = None
    reports: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    tool: str = "nucleus-export"
    tool_version: str = field(default_factory=tool_version)
    created_at: str | None = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> bytes:
        return (json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n").encode()

    @classmethod
    def load(cls, directory: str | Path) -> "OutputManifest":
        data = json.loads((Path(directory) / MANIFEST_NAME).read_text())
        return cls(**data)
