"""How errors leave the API: JSON ``{"code", "message", "field"?}`` with a status from one table.

The codes are the engine's and the store's (converters/errors.py), so a
client sees the same code from the API, the CLI and a failed operation.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from converters import errors as E
from converters.errors import ExportError

STATUS = {
    E.UNAUTHORIZED: 401, E.FORBIDDEN: 403, E.NOT_FOUND: 404, E.VALIDATION_FAILED: 422,
    E.OPERATION_NOT_FOUND: 404, E.CHECKPOINT_NOT_FOUND: 404, E.WEBHOOK_NOT_FOUND: 404, E.RULE_NOT_FOUND: 404, E.ARTIFACT_NOT_FOUND: 404,
    E.IDEMPOTENCY_CONFLICT: 422, E.IDEMPOTENCY_IN_PROGRESS: 409, E.INVALID_TRANSITION: 409, E.CHECKPOINT_EXISTS: 409,
    E.CHECKPOINT_DELETED: 410, E.ARCHIVE_NOT_DOWNLOADABLE: 409, E.URL_EXPIRED: 410, E.URL_BAD_SIGNATURE: 403,
    E.HOOK_BAD_SIGNATURE: 401, E.UNKNOWN_FORMAT: 422, E.INVALID_OPTION: 422, E.DESTINATION_UNSUPPORTED: 422, E.HUB_REPO_INVALID: 422,
    E.SECRET_NOT_FOUND: 422, E.WEBHOOK_URL_REFUSED: 422, E.ARCHIVE_URI_REFUSED: 422, E.FETCH_UNSUPPORTED: 422,
}
_BY_KIND = {"input": 400, "transient": 503, "internal": 500}


def status_for(exc: ExportError) -> int:
    return STATUS.get(exc.code, _BY_KIND[exc.kind])


def body(code: str, message: str, field: str | None = None) -> dict:
    return {"code": code, "message": message, **({"field": field} if field else {})}


async def export_error(_request: Request, exc: ExportError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.code == E.UNAUTHORIZED else None
    return JSONResponse(body(exc.code, exc.message, exc.field), status_code=status_for(exc), headers=headers)


async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "header")]
    field = ".".join(loc) or None
    msg = f"{field}: {first.get('msg')}" if field else str(first.get("msg"))
    return JSONResponse(body(E.VALIDATION_FAILED, msg, field), status_code=422)


async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: E.NOT_FOUND, 405: E.NOT_FOUND, 401: E.UNAUTHORIZED, 403: E.FORBIDDEN}.get(exc.status_code, E.VALIDATION_FAILED if exc.status_code < 500 else E.INTERNAL)
    return JSONResponse(body(code, str(exc.detail)), status_code=exc.status_code, headers=getattr(exc, "headers", None))


async def internal_error(_request: Request, exc: Exception) -> JSONResponse:
    import logging

    logging.getLogger("nucleus_export.api").exception("unhandled error")
    return JSONResponse(body(E.INTERNAL, "an unexpected internal error occurred; it has been logged."), status_code=500)
