"""Downloads through local signed URLs (S3 URLs go straight to S3)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from converters import errors as E
from converters.errors import ExportError

from ..artifacts import LocalStore

router = APIRouter()


_RESPONSES = {200: {"content": {"application/octet-stream": {}}}, 206: {"description": "a byte range"}, 403: {"description": "bad signature"},
              410: {"description": "the link expired"}, 416: {"description": "range not satisfiable"}}


@router.head("/v1/artifacts/{key:path}", tags=["artifacts"], response_class=StreamingResponse, responses=_RESPONSES, operation_id="head_artifact")
@router.get("/v1/artifacts/{key:path}", tags=["artifacts"], response_class=StreamingResponse, responses=_RESPONSES, operation_id="download_artifact")
def download(key: str, request: Request):
    """A file behind a signed URL: byte ranges, If-Range with a strong ETag, Content-Disposition."""
    artifacts = request.app.state.services.artifacts
    if not isinstance(artifacts, LocalStore):
        raise ExportError(E.NOT_FOUND, "this server's artifacts are in S3; use the presigned URL you were given.")
    path = (request.scope.get("raw_path") or request.url.path.encode()).decode("latin-1")  # signed as sent: percent-encoded
    r = artifacts.serve(request.method, path, dict(request.query_params), dict(request.headers))
    return StreamingResponse(r.body, status_code=r.status, headers=r.headers)
