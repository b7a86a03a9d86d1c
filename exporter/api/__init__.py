"""The HTTP API (FastAPI). ``create_app(services)`` builds it; ``nucleus-export serve`` runs it under uvicorn."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from converters.errors import ExportError

from . import errors, routes_artifacts, routes_checkpoints, routes_exports, routes_webhooks

DESCRIPTION = """Export LoRA checkpoints as merged Hugging Face models, PEFT adapters and GGUF files.

Authenticate with `Authorization: Bearer nxk_…` (scopes `read`, `train`, `infer`).
Errors are JSON `{"code", "message", "field"?}` with the codes listed in docs/errors.md.
`POST …/export` honours `Idempotency-Key`."""


def create_app(services, *, background: dict | None = None) -> FastAPI:
    """``background``: keyword arguments for ``services.start`` when the app starts (None: start nothing)."""

    @asynccontextmanager
    async def lifespan(_app):
        if background is not None:
            services.start(**background)
        try:
            yield
        finally:
            if background is not None:
                services.stop()

    from converters.manifest import tool_version

    app = FastAPI(title="nucleus-export", version=tool_version(), description=DESCRIPTION, lifespan=lifespan)
    app.state.services = services
    app.add_exception_handler(ExportError, errors.export_error)
    app.add_exception_handler(RequestValidationError, errors.validation_error)
    app.add_exception_handler(StarletteHTTPException, errors.http_error)
    app.add_exception_handler(Exception, errors.internal_error)
    for r in (routes_exports, routes_checkpoints, routes_webhooks, routes_artifacts):
        app.include_router(r.router)

    @app.get("/healthz", tags=["service"])
    def healthz() -> dict:
        return {"status": "ok"}

    return app
