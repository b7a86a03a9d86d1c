"""The ``signed-url`` destination: files go to the artifact store; the result lists a signed URL per file."""

from __future__ import annotations

from pathlib import Path

from converters.io.files import sha256_file

from ..artifacts import LocalStore
from . import PublishContext, output_files


def _key(op_id: str, name: str) -> str:
    return f"exports/{op_id}/{name}"


def preflight(request: dict, ctx: PublishContext) -> None:
    pass  # nothing to check: the artifact store was opened when the worker started


def publish(op, out: Path, ctx: PublishContext, progress=None) -> dict:
    files = output_files(out)
    total, done, result = sum(f["size"] for f in files), 0, []
    for f in files:
        key = _key(op.id, f["name"])
        stored = isinstance(ctx.artifacts, LocalStore) and ctx.artifacts.exists(key) and sha256_file(ctx.artifacts.path(key)) == f["sha256"]
        if not stored:
            ctx.artifacts.put_file(out / f["name"], key)  # same key, same bytes: a repeat is harmless
        done += f["size"]
        if progress:
            progress(done, total, f"stored {f['name']}")
        signed = ctx.artifacts.signed_url(key, ctx.url_ttl_seconds)
        result.append({"name": f["name"], "url": signed.url, "size": f["size"], "sha256": f["sha256"], "expires_at": signed.expires_at.isoformat()})
    return {"format": op.request["format"], "destination": "signed-url", "files": result}


def fresh_urls(op, artifacts, ttl_seconds: int) -> dict:
    """New signed URLs for the files of a finished signed-url export."""
    files = []
    for f in op.result["files"]:
        signed = artifacts.signed_url(_key(op.id, f["name"]), ttl_seconds)
        files.append({**f, "url": signed.url, "expires_at": signed.expires_at.isoformat()})
    return {**op.result, "files": files}
