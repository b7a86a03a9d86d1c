"""Exports and operations."""

from __future__ import annotations

from dataclasses import fields

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import JSONResponse

from converters import errors as E
from converters.errors import ExportError

from .. import checkpoint_ref
from ..exports import ExportSpec, submit
from ..runner import fresh_urls
from ..store import STATUSES, fingerprint
from ..store.keys import ApiKey
from .auth import require
from .models import EventList, ExportAccepted, ExportBody, OperationList, OperationOut, operation_out

router = APIRouter()
RETRY_AFTER_SECONDS = 2


def spec_from(body) -> ExportSpec:
    d = body.model_dump()
    return ExportSpec(**{f.name: d[f.name] for f in fields(ExportSpec) if f.name in d})


@router.post("/v1/training-runs/{run_id}/checkpoints/{checkpoint_id:path}/export", status_code=202, response_model=ExportAccepted, tags=["exports"],
             responses={409: {"description": "a request with this Idempotency-Key is still being processed"},
                        422: {"description": "invalid request, or the Idempotency-Key was used with another body"}})
def start_export(run_id: str, checkpoint_id: str, body: ExportBody, request: Request, key: ApiKey = require("train"),
                 idempotency_key: str | None = Header(None, alias="Idempotency-Key", max_length=255)):
    """Start an export of a registered checkpoint. Answers 202 with the operation to poll."""
    s = request.app.state.services
    ref = checkpoint_ref.resolve(run_id, checkpoint_id)
    if idempotency_key is not None:
        fp = fingerprint({"run_id": ref.run_id, "checkpoint_id": ref.checkpoint_id, "body": body.model_dump()})
        replay = s.idempotency.begin(key.tenant, idempotency_key, fp)
        if replay is not None:
            return JSONResponse(replay.body, status_code=replay.status_code, headers={**replay.headers, "Idempotent-Replayed": "true"})
    try:
        ck = s.checkpoints.get(key.tenant, ref.run_id, ref.checkpoint_id)
        op, _ = submit(s, key.tenant, ck, spec_from(body), op_key=f"api:{key.tenant}:{idempotency_key}" if idempotency_key else None)
    except BaseException:
        if idempotency_key is not None:
            s.idempotency.abandon(key.tenant, idempotency_key)  # nothing was created: the client may retry with this key
        raise
    content = {"operation": op.id, "format": op.format, "status": op.status}
    headers = {"Location": f"/v1/operations/{op.id}"}
    if idempotency_key is not None:
        s.idempotency.finish(key.tenant, idempotency_key, 202, content, headers)
    return JSONResponse(content, status_code=202, headers=headers)


@router.get("/v1/operations/{operation_id}", response_model=OperationOut, tags=["operations"])
def get_operation(operation_id: str, request: Request, key: ApiKey = require("read")):
    """An operation's status, stage, progress, result and error. ``Retry-After`` while it is not finished."""
    op = request.app.state.services.store.get(operation_id, tenant=key.tenant)
    headers = {} if op.finished else {"Retry-After": str(RETRY_AFTER_SECONDS)}
    return JSONResponse(operation_out(op), headers=headers)


@router.get("/v1/operations", response_model=OperationList, tags=["operations"])
def list_operations(request: Request, key: ApiKey = require("read"), status: str | None = Query(None, description=" | ".join(STATUSES)),
                    run: str | None = Query(None, max_length=200), format: str | None = Query(None, max_length=40),
                    limit: int = Query(50, ge=1, le=200), cursor: str | None = Query(None, max_length=400)):
    if status is not None and status not in STATUSES:
        raise ExportError(E.VALIDATION_FAILED, f"status must be one of {', '.join(STATUSES)}.", field="status")
    ops, nxt = request.app.state.services.store.list(tenant=key.tenant, status=status, run_id=run, format=format, limit=limit, cursor=cursor)
    return {"data": [operation_out(o) for o in ops], "next_cursor": nxt}


@router.get("/v1/operations/{operation_id}/events", response_model=EventList, tags=["operations"])
def operation_events(operation_id: str, request: Request, key: ApiKey = require("read"), after: int = Query(0, ge=0, le=2**62)):
    s = request.app.state.services
    s.store.get(operation_id, tenant=key.tenant)
    return {"data": [{"seq": e.seq, "at": e.at.isoformat(), "kind": e.kind, "data": e.data} for e in s.store.events(operation_id, after=after)]}


@router.post("/v1/operations/{operation_id}/cancel", status_code=202, response_model=OperationOut, tags=["operations"])
def cancel_operation(operation_id: str, request: Request, key: ApiKey = require("train")):
    """Queued: cancelled at once. Running: cancelling, until its worker stops the job and cleans up."""
    s = request.app.state.services
    s.store.get(operation_id, tenant=key.tenant)
    op = s.store.cancel(operation_id)
    s.queue.cancel(op)  # distributed mode: abort the job wherever it runs
    return JSONResponse(operation_out(op), status_code=202)


@router.post("/v1/operations/{operation_id}/download-urls", response_model=OperationOut, tags=["operations"])
def refresh_urls(operation_id: str, request: Request, key: ApiKey = require("read")):
    """Fresh signed URLs for a finished signed-url export, without exporting again."""
    s = request.app.state.services
    op = s.store.get(operation_id, tenant=key.tenant)
    return {**operation_out(op), "result": fresh_urls(s.store, s.artifacts, op.id, s.settings.url_ttl_seconds)}
