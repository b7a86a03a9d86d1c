"""The ``hf-hub`` destination: one commit to a Hugging Face Hub repo, through huggingface_hub.

``create_repo`` (private unless the request says otherwise, ``exist_ok``), the
branch if a revision other than main is asked for, then ONE ``create_commit``
carrying every file and the model card. huggingface_hub leaves out files whose
content the repo already has at that revision and makes no commit when nothing
changed, which is what makes a repeated publish (a job resumed after a crash)
add no second commit.

The token comes from the request's secret reference or the server's
configuration and is handed to huggingface_hub only; it never reaches the
operation, its events or a log line. 429, 5xx and network failures are retried
here with backoff (honouring Retry-After), then reported as transient so the
runner retries the job; 401/403 fail at once with their own codes.
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path
from typing import Callable, TypeVar

from converters import errors as E
from converters.errors import ExportError
from converters.manifest import MANIFEST_NAME

from .. import secrets
from . import PublishContext, model_card, output_files

T = TypeVar("T")

# the Hub's own rule for repo names: namespace/name, 1-96 characters each, no '--' or '..'
_REPO_ID = re.compile(r"(?!.*(--|\.\.))[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")


def validate_repo_id(repo_id: str | None) -> str:
    if not repo_id or not _REPO_ID.fullmatch(repo_id) or repo_id.endswith((".git", ".")):
        raise ExportError(E.HUB_REPO_INVALID, f"hf_repo {repo_id!r} is not a valid Hub repo id; write it as namespace/name (letters, digits, '-', '_', '.').", field="hf_repo")
    return repo_id


def token_for(request: dict, ctx: PublishContext) -> str:
    ref = request.get("hf_token_ref")
    if ref:
        return secrets.resolve(ref, ctx.secrets_dir)
    if ctx.hf_token:
        return ctx.hf_token
    raise ExportError(E.HUB_UNAUTHORIZED, "no Hugging Face token is configured for hf-hub exports; set NUCLEUS_EXPORT_HF_TOKEN on the workers or pass hf_token_ref: secret:NAME.", field="hf_token_ref")


def preflight(request: dict, ctx: PublishContext) -> None:
    validate_repo_id(request.get("hf_repo"))
    token_for(request, ctx)


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def _retry_after(exc: BaseException) -> float | None:
    response = getattr(exc, "response", None)
    value = getattr(response, "headers", {}).get("Retry-After") if response is not None else None
    try:
        return min(60.0, float(value)) if value else None
    except ValueError:
        return None


def _transport_errors() -> tuple[type[BaseException], ...]:
    try:
        import httpx2

        return (httpx2.TransportError, ConnectionError, TimeoutError)
    except ImportError:  # pragma: no cover - huggingface_hub always brings it
        return (ConnectionError, TimeoutError)


def call(what: str, repo_id: str, fn: Callable[[], T], ctx: PublishContext) -> T:
    """Run one Hub call, retrying 429/5xx/network failures; map the rest to our codes."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    transport = _transport_errors()
    for attempt in range(1, ctx.hub_retries + 1):
        try:
            return fn()
        except OfflineModeIsEnabled:
            raise ExportError(E.DESTINATION_UNSUPPORTED, "this worker runs with HF_HUB_OFFLINE set, so it cannot publish to the Hub; unset it on the workers that take hf-hub exports.", field="destination") from None
        except HfHubHTTPError as exc:
            status = _status(exc)
            if status == 401:
                raise ExportError(E.HUB_UNAUTHORIZED, f"the Hub refused the token while trying to {what} ({repo_id}): it is invalid or expired; configure a valid write token.") from None
            if status == 403:
                raise ExportError(E.HUB_FORBIDDEN, f"the Hub token may not {what} in {repo_id}; use a token with write access to that namespace, or another hf_repo.", field="hf_repo") from None
            if status is not None and status != 429 and status < 500:
                detail = str(exc).splitlines()[0][:300]
                raise ExportError(E.HUB_REJECTED, f"the Hub refused to {what} in {repo_id} (HTTP {status}): {detail}", field="hf_repo") from None
            last = f"HTTP {status}" if status else exc.__class__.__name__
            wait = _retry_after(exc)
        except transport as exc:
            last, wait = exc.__class__.__name__, None
        if attempt == ctx.hub_retries:
            break
        time.sleep(wait if wait is not None else min(30.0, ctx.hub_backoff_base * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0))
    raise ExportError(E.HUB_UNAVAILABLE, f"the Hub did not answer while trying to {what} in {repo_id} ({last}, {ctx.hub_retries} tries); the export will be retried.")


def publish(op, out: Path, ctx: PublishContext, progress=None) -> dict:
    from huggingface_hub import CommitOperationAdd, HfApi

    req = op.request
    repo_id = validate_repo_id(req.get("hf_repo"))
    opts = req.get("hub") or {}
    revision = opts.get("revision") or "main"
    api = HfApi(endpoint=ctx.hf_endpoint, token=token_for(req, ctx), library_name="nucleus-export")

    repo_url = call("create the repo", repo_id, lambda: api.create_repo(repo_id, repo_type="model", private=opts.get("private", True), exist_ok=True), ctx)
    if revision != "main":
        call("create the branch", repo_id, lambda: api.create_branch(repo_id, branch=revision, exist_ok=True), ctx)

    files = output_files(out)
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    operations = [CommitOperationAdd(path_in_repo=f["name"], path_or_fileobj=str(out / f["name"])) for f in files]
    has_card = call("read the model card", repo_id, lambda: api.file_exists(repo_id, "README.md", revision=revision), ctx)
    # an existing card is the repo owner's: kept unless the request asks to replace it
    if (opts.get("replace_card", False) or not has_card) and not any(f["name"] == "README.md" for f in files):
        card = model_card.build(req["format"], repo_id, manifest, [f["name"] for f in files])
        operations.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=str(card).encode()))

    message = opts.get("commit_message") or f"Export {req['format']} of {req.get('run_id') or 'run'} checkpoint {req.get('checkpoint_id') or ''}".strip()
    if progress:
        progress(0, 1, f"committing {len(operations)} files to {repo_id}")
    info = call("commit", repo_id, lambda: api.create_commit(repo_id, operations, commit_message=message, revision=revision,
                                                                   commit_description="Exported by nucleus-export; checksums in nucleus-export.json."), ctx)
    if progress:
        progress(1, 1, f"committed {info.oid[:12]}")
    return {
        "format": req["format"], "destination": "hf-hub", "repo": repo_id, "repo_url": str(repo_url), "revision": revision,
        "commit": info.oid, "commit_url": info.commit_url,
        "files": [{"name": f["name"], "size": f["size"], "sha256": f["sha256"]} for f in files],
    }
