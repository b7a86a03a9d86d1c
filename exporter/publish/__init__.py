"""Publishers: where a converted output goes. One function per destination, chosen by table.

Every publisher is idempotent: publishing the same files to the same
destination again uploads nothing new and records no second commit, so a job
resumed after a crash in the publishing stage ends exactly as an undisturbed one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from converters import errors as E
from converters.errors import ExportError
from converters.io.files import sha256_file
from converters.manifest import MANIFEST_NAME


@dataclass(frozen=True)
class PublishContext:
    artifacts: object  # LocalStore or S3Store
    url_ttl_seconds: int
    hf_endpoint: str | None = None
    hf_token: str | None = field(default=None, repr=False)  # a secret: never in reprs or logs
    secrets_dir: Path | None = None
    hub_retries: int = 4
    hub_backoff_base: float = 1.0


def output_files(out: Path) -> list[dict]:
    """Every file of a converted output, the manifest last: {name, size, sha256}."""
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    mf = out / MANIFEST_NAME
    return [*manifest["files"], {"name": MANIFEST_NAME, "size": mf.stat().st_size, "sha256": sha256_file(mf)}]


DESTINATIONS = ("signed-url", "hf-hub")


def _module(request: dict):
    from . import hf_hub, signed_url

    dest = request.get("destination", "signed-url")
    modules = {"signed-url": signed_url, "hf-hub": hf_hub}
    if dest not in modules:
        raise ExportError(E.DESTINATION_UNSUPPORTED, f"destination {dest!r} is not known; use one of {', '.join(DESTINATIONS)}.", field="destination")
    return modules[dest]


def preflight(request: dict, ctx: PublishContext) -> None:
    """Check what can be checked about the destination before any work is done (repo id, token)."""
    _module(request).preflight(request, ctx)


def publish(op, out: Path, ctx: PublishContext, progress: Callable[[int, int, str], None] | None = None) -> dict:
    return _module(op.request).publish(op, out, ctx, progress)
