"""``nucleus-export serve``: the HTTP API under uvicorn, with in-process workers by default."""

from __future__ import annotations

from converters.errors import EXIT_OK

from ..settings import Settings
from ..settings import redact_url as _redact
from .errors import guarded


def register(sub) -> None:
    p = sub.add_parser("serve", help="run the HTTP API (embedded: SQLite, local artifacts, in-process workers)")
    p.add_argument("--host", help="listen address (default NUCLEUS_EXPORT_HOST or 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default NUCLEUS_EXPORT_PORT or 8000)")
    p.add_argument("--workers", type=int, help="in-process export workers (default NUCLEUS_EXPORT_WORKERS or 1)")
    p.add_argument("--no-workers", action="store_true", help="API only: workers run elsewhere (`nucleus-export worker`)")
    p.add_argument("--db", help="operations store URL (default NUCLEUS_EXPORT_DATABASE_URL, or SQLite in the data directory)")
    p.add_argument("--store", help="artifact store: s3://bucket/prefix (default a local folder in the data directory)")
    p.set_defaults(func=run)


def settings_from(args) -> Settings:
    from dataclasses import replace

    s = Settings.from_env()
    over = {k: v for k, v in {"host": getattr(args, "host", None), "port": getattr(args, "port", None), "database_url": getattr(args, "db", None),
                              "artifact_store": getattr(args, "store", None)}.items() if v is not None}
    return replace(s, **over)


@guarded
def run(args) -> int:
    import uvicorn

    from ..api import create_app
    from ..service import Services

    settings = settings_from(args)
    workers = 0 if args.no_workers else (args.workers if args.workers is not None else settings.workers)
    services = Services(settings)
    app = create_app(services, background={"workers": workers})
    print(f"nucleus-export serving on http://{settings.host}:{settings.port} with {workers} in-process worker(s); store {_redact(settings.store_url())}, "
          f"{services.queue.name} queue", flush=True)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="info")
    services.close()
    return EXIT_OK


