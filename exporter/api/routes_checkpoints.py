"""Checkpoints (the trainer's side), their expiry and download URLs; export rules; the inbound checkpoint-saved hook."""

from __future__ import annotations

import json
import re
from dataclasses import fields

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from converters import errors as E
from converters.errors import ExportError

from .. import checkpoint_ref
from ..exports import ExportSpec, submit, validate
from ..store.keys import ApiKey
from ..archive_uris import check_registrable, owned_location
from .auth import require
from .models import CheckpointBody, CheckpointList, CheckpointOut, ExpiryBody, HookResult, RuleBody, RuleList, RuleOut, SignedUrlOut

router = APIRouter()


def _ref_from_body(run_id: str, body: CheckpointBody) -> checkpoint_ref.CheckpointRef:
    if bool(body.checkpoint) == bool(body.checkpoint_id):
        raise ExportError(E.VALIDATION_FAILED, "give exactly one of checkpoint_id and checkpoint (a nucleus:// URI).", field="checkpoint_id")
    return checkpoint_ref.resolve(run_id, body.checkpoint or body.checkpoint_id)


@router.post("/v1/training-runs/{run_id}/checkpoints", status_code=201, response_model=CheckpointOut, tags=["checkpoints"])
def register_checkpoint(run_id: str, body: CheckpointBody, request: Request, key: ApiKey = require("train")):
    """Register a checkpoint archive. Registering the same archive again answers 200 with the existing record."""
    ref = _ref_from_body(run_id, body)
    s = request.app.state.services
    check_registrable(body.uri, key.tenant, s.artifacts, roots=s.settings.archive_root_list(), buckets=s.settings.archive_bucket_list())
    ck, created = s.checkpoints.register(key.tenant, ref.run_id, ref.checkpoint_id, uri=body.uri, sha256=body.sha256, size=body.size,
                                                                 base_model=body.base_model, step=body.step, ttl_seconds=body.ttl_seconds)
    return JSONResponse(ck.to_dict(), status_code=201 if created else 200)


@router.get("/v1/training-runs/{run_id}/checkpoints", response_model=CheckpointList, tags=["checkpoints"])
def list_checkpoints(run_id: str, request: Request, key: ApiKey = require("read")):
    checkpoint_ref.validate_run(run_id)
    return {"data": [c.to_dict() for c in request.app.state.services.checkpoints.list(key.tenant, run_id)]}


@router.get("/v1/training-runs/{run_id}/checkpoints/{checkpoint_id:path}/download-url", response_model=SignedUrlOut, tags=["checkpoints"])
def checkpoint_download_url(run_id: str, checkpoint_id: str, request: Request, key: ApiKey = require("read")):
    """A signed URL for the raw archive. From S3 it is a presigned URL: the bytes never pass through this service."""
    s = request.app.state.services
    ref = checkpoint_ref.resolve(run_id, checkpoint_id)
    ck = s.checkpoints.get(key.tenant, ref.run_id, ref.checkpoint_id)
    where = owned_location(ck.uri, s.artifacts)
    if where is None:
        raise ExportError(E.ARCHIVE_NOT_DOWNLOADABLE, f"the archive of {ck.ref} is at {ck.uri.split('?')[0]}, outside this service's artifact store; download it from there.", field="checkpoint_id")
    signed = s.artifacts.signed_url(where.key, s.settings.url_ttl_seconds)
    return {"url": signed.url, "expires_at": signed.expires_at.isoformat()}


@router.patch("/v1/training-runs/{run_id}/checkpoints/{checkpoint_id:path}/expiry", response_model=CheckpointOut, tags=["checkpoints"])
def set_checkpoint_expiry(run_id: str, checkpoint_id: str, body: ExpiryBody, request: Request, key: ApiKey = require("train")):
    """``{"ttl_seconds": N}`` expires the archive N seconds from now; ``{"ttl_seconds": null}`` keeps it forever."""
    ref = checkpoint_ref.resolve(run_id, checkpoint_id)
    return request.app.state.services.checkpoints.set_expiry(key.tenant, ref.run_id, ref.checkpoint_id, body.ttl_seconds).to_dict()


@router.get("/v1/training-runs/{run_id}/checkpoints/{checkpoint_id:path}", response_model=CheckpointOut, tags=["checkpoints"])
def get_checkpoint(run_id: str, checkpoint_id: str, request: Request, key: ApiKey = require("read")):
    ref = checkpoint_ref.resolve(run_id, checkpoint_id)
    return request.app.state.services.checkpoints.get(key.tenant, ref.run_id, ref.checkpoint_id, include_deleted=True).to_dict()


# --- export rules and the inbound hook ------------------------------------------------------


def _rule_spec(rule, fmt: str) -> ExportSpec:
    o = dict(rule.options or {})
    if fmt != "gguf":
        o.pop("quant", None)  # one quant option serves the gguf format of a multi-format rule
    options = {f.name: o[f.name] for f in fields(ExportSpec) if f.name in o and f.name not in ("format", "destination", "hf_repo")}
    return ExportSpec(format=fmt, destination=rule.destination, hf_repo=rule.hf_repo, **options)


@router.post("/v1/training-runs/{run_id}/export-rules", status_code=201, response_model=RuleOut, tags=["export rules"])
def create_rule(run_id: str, body: RuleBody, request: Request, key: ApiKey = require("train")):
    """Export every new checkpoint of the run (or every n-th step) in these formats, when the trainer's hook announces it."""
    checkpoint_ref.validate_run(run_id)
    options = body.model_dump(exclude={"formats", "destination", "hf_repo", "every_n_steps"}, exclude_none=True)
    if not options.get("replace_card"):
        options.pop("replace_card", None)
    from ..store.rules import ExportRule

    draft = ExportRule("", key.tenant, run_id, list(body.formats), body.destination, body.hf_repo, body.every_n_steps, options, None)
    for fmt in body.formats:
        validate(_rule_spec(draft, fmt))
    rule = request.app.state.services.rules.create(key.tenant, run_id, formats=list(body.formats), destination=body.destination, hf_repo=body.hf_repo,
                                                   every_n_steps=body.every_n_steps, options=options)
    return rule.to_dict()


@router.get("/v1/training-runs/{run_id}/export-rules", response_model=RuleList, tags=["export rules"])
def list_rules(run_id: str, request: Request, key: ApiKey = require("read")):
    return {"data": [r.to_dict() for r in request.app.state.services.rules.list(key.tenant, run_id)]}


@router.delete("/v1/training-runs/{run_id}/export-rules/{rule_id}", status_code=204, tags=["export rules"])
def delete_rule(run_id: str, rule_id: str, request: Request, key: ApiKey = require("train")):
    request.app.state.services.rules.delete(key.tenant, rule_id)


@router.post("/v1/hooks/checkpoint-saved", response_model=HookResult, tags=["hooks"])
async def checkpoint_saved(request: Request):
    """The trainer announces a saved checkpoint (signed with Standard Webhooks under the shared secret).

    Registers it for every tenant with export rules on its run and starts the
    exports those rules ask for: exactly once per checkpoint, rule and format,
    however often the hook is delivered.
    """
    from standardwebhooks.webhooks import Webhook, WebhookVerificationError

    s = request.app.state.services
    secret = s.settings.inbound_webhook_secret
    if not secret:
        raise ExportError(E.NOT_FOUND, "the checkpoint-saved hook is not configured on this server (NUCLEUS_EXPORT_INBOUND_WEBHOOK_SECRET).")
    raw = await request.body()
    try:
        Webhook(secret).verify(raw, {k: v for k, v in request.headers.items()})
    except WebhookVerificationError as exc:
        raise ExportError(E.HOOK_BAD_SIGNATURE, f"the hook's signature does not verify ({exc}); sign it with the shared whsec_ secret.") from None
    try:
        payload = json.loads(raw)
        data = payload["data"]
        ref = checkpoint_ref.parse(data["checkpoint"])
        uri = data["uri"]
        step = data.get("step")
        if step is not None and (not isinstance(step, int) or step < 0):
            raise ValueError("step")
        if data.get("base_model") is not None and not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", str(data["base_model"])):
            raise ValueError("base_model")
    except (ValueError, KeyError, TypeError) as exc:
        if isinstance(exc, ExportError):
            raise
        raise ExportError(E.VALIDATION_FAILED, "the hook body must be {\"type\": \"checkpoint.saved\", \"data\": {\"checkpoint\": \"nucleus://…\", \"uri\": …, \"base_model\"?, \"step\"?, \"sha256\"?, \"size\"?}}.", field="data") from None
    results = []
    for rule in s.rules.list(None, ref.run_id):
        ck, _ = s.checkpoints.register(rule.tenant, ref.run_id, ref.checkpoint_id, uri=uri, sha256=data.get("sha256"), size=data.get("size"),
                                       base_model=data.get("base_model"), step=step)
        if not rule.applies_to(ck.step):
            continue
        for fmt in rule.formats:
            op, created = submit(s, rule.tenant, ck, _rule_spec(rule, fmt), op_key=f"rule:{rule.id}:{fmt}:{ck.run_id}/{ck.checkpoint_id}")
            results.append({"operation": op.id, "format": fmt, "status": op.status, "rule_id": rule.id, "created": created})
    return {"checkpoint": f"nucleus://{ref.run_id}/{ref.checkpoint_id}", "operations": results}
