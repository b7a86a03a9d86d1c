"""A small client for the HTTP API, used by the CLI's submit/status/wait/cancel/download/batch and the demo.

Server errors come back as the same ``ExportError`` codes the server raised,
so the CLI's exit codes and messages are the same locally and remotely.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from urllib.parse import quote

import requests

from converters import errors as E
from converters.errors import ExportError
from converters.io.files import sha256_file

from . import checkpoint_ref

TERMINAL = {"succeeded", "failed", "cancelled"}


class ApiClient:
    def __init__(self, server: str, key: str | None, *, timeout: float = 60.0, retries: int = 4):
        self.server, self.timeout, self.retries = server.rstrip("/"), timeout, retries
        self.session = requests.Session()
        if key:
            self.session.headers["Authorization"] = f"Bearer {key}"

    def _call(self, method: str, path: str, *, expect=(200, 201, 202, 204), **kw) -> requests.Response:
        last = None
        for attempt in range(self.retries):
            try:
                r = self.session.request(method, self.server + path, timeout=self.timeout, **kw)
            except requests.ConnectionError as exc:
                last = ExportError(E.FETCH_FAILED, f"cannot reach the server at {self.server} ({exc.__class__.__name__}); is `nucleus-export serve` running?")
            else:
                if r.status_code in expect:
                    return r
                last = _error_from(r)
                # 409 on an Idempotency-Key means "the same request is still being processed": ask again shortly
                if not (r.status_code >= 500 or r.status_code == 429 or (r.status_code == 409 and last.code == E.IDEMPOTENCY_IN_PROGRESS)):
                    raise last
            time.sleep(min(10.0, 0.5 * 2 ** attempt))
        raise last

    def register_checkpoint(self, checkpoint: str, uri: str, **fields) -> dict:
        ref = checkpoint_ref.parse(checkpoint)
        body = {"checkpoint": checkpoint, "uri": uri, **{k: v for k, v in fields.items() if v is not None}}
        return self._call("POST", f"/v1/training-runs/{ref.run_id}/checkpoints", json=body).json()

    def submit(self, checkpoint: str, body: dict, *, idempotency_key: str | None = None) -> dict:
        ref = checkpoint_ref.parse(checkpoint)
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        path = f"/v1/training-runs/{ref.run_id}/checkpoints/{quote(ref.checkpoint_id, safe='/')}/export"
        return self._call("POST", path, json=body, headers=headers).json()

    def operation(self, op_id: str) -> dict:
        return self._call("GET", f"/v1/operations/{op_id}").json()

    def cancel(self, op_id: str) -> dict:
        return self._call("POST", f"/v1/operations/{op_id}/cancel").json()

    def fresh_urls(self, op_id: str) -> dict:
        return self._call("POST", f"/v1/operations/{op_id}/download-urls").json()

    def wait(self, op_id: str, *, on_update=None, poll: float = 1.0, timeout: float | None = None) -> dict:
        deadline = time.monotonic() + timeout if timeout else None
        while True:
            op = self.operation(op_id)
            if on_update:
                on_update(op)
            if op["status"] in TERMINAL:
                return op
            if deadline and time.monotonic() > deadline:
                raise ExportError(E.FETCH_FAILED, f"operation {op_id} did not finish within {timeout:.0f} s; it is still {op['status']}.")
            time.sleep(poll)

    def download(self, op: dict, dest: Path, *, on_bytes=None) -> list[Path]:
        """Every file of a finished signed-url export into ``dest``: resumed with Range, sha256 checked, renamed into place."""
        if op.get("status") != "succeeded" or (op.get("result") or {}).get("destination") != "signed-url":
            raise ExportError(E.INVALID_TRANSITION, f"operation {op.get('operation')} has no downloadable files ({op.get('status')}).")
        if any(_expired(f) for f in op["result"]["files"]):
            op = self.fresh_urls(op["operation"])
        dest.mkdir(parents=True, exist_ok=True)
        out = []
        for f in op["result"]["files"]:
            out.append(_fetch(f, dest, on_bytes))
        return out


def _expired(f: dict) -> bool:
    from datetime import datetime, timezone

    return datetime.fromisoformat(f["expires_at"]) <= datetime.now(timezone.utc)


def _fetch(f: dict, dest: Path, on_bytes=None) -> Path:
    name = Path(f["name"]).name  # never a path from the server
    final, part = dest / name, dest / f".{name}.part"
    if final.is_file() and final.stat().st_size == f["size"] and sha256_file(final) == f["sha256"]:
        return final
    have = part.stat().st_size if part.exists() else 0
    headers = {"Range": f"bytes={have}-"} if have else {}
    with requests.get(f["url"], headers=headers, stream=True, timeout=60) as r:
        if r.status_code == 200:
            have = 0  # the server sent it all
        elif r.status_code != 206:
            raise _error_from(r)
        with open(part, "ab" if have else "wb") as fh:
            for chunk in r.iter_content(1 << 20):
                fh.write(chunk)
                if on_bytes:
                    on_bytes(len(chunk))
            fh.flush()
            os.fsync(fh.fileno())
    if sha256_file(part) != f["sha256"]:
        part.unlink()
        raise ExportError(E.FETCH_FAILED, f"{name} arrived with the wrong sha256; run the download again.")
    os.replace(part, final)
    return final


def _error_from(r: requests.Response) -> ExportError:
    try:
        body = r.json()
        code, message, field = body["code"], body["message"], body.get("field")
    except (ValueError, KeyError, TypeError):
        code, message, field = (E.FETCH_FAILED if r.status_code >= 500 or r.status_code == 429 else E.VALIDATION_FAILED), f"HTTP {r.status_code}: {r.text[:200]}", None
    if code not in E.catalogue():
        code = E.INTERNAL
    return ExportError(code, message, field=field)
