"""``nucleus-export worker``: run export jobs from the operations store until stopped."""

from __future__ import annotations

import os
import signal
import socket
import threading

from converters.errors import EXIT_OK

from ..settings import Settings
from .errors import guarded


def register(sub) -> None:
    p = sub.add_parser("worker", help="run queued export jobs (SQLite by default, PostgreSQL with NUCLEUS_EXPORT_DATABASE_URL)")
    p.add_argument("--once", action="store_true", help="run at most one job, then exit")
    p.add_argument("--max-jobs", type=int, help="exit after this many jobs")
    p.add_argument("--poll-seconds", type=float, default=1.0)
    p.set_defaults(func=run)


def build_worker(settings: Settings, worker_id: str | None = None):
    from ..artifacts import LocalStore
    from ..runner import RunnerConfig, Worker
    from ..store import Store

    store = Store(settings.store_url())
    artifacts = LocalStore(settings.data_dir / "artifacts", settings.signing_key_map(), base_url=settings.public_base_url)
    config = RunnerConfig(work_dir=settings.data_dir / "work", lease_seconds=settings.lease_seconds, heartbeat_seconds=settings.heartbeat_seconds,
                          max_attempts=settings.max_attempts, url_ttl_seconds=settings.url_ttl_seconds, model_store=settings.model_store,
                          s3_endpoint_url=settings.s3_endpoint_url)
    return Worker(store, artifacts, config, worker_id or f"{socket.gethostname()}:{os.getpid()}")


@guarded
def run(args) -> int:
    worker = build_worker(Settings.from_env())
    stop = threading.Event()
    # SIGTERM/SIGINT: finish the current job, then stop (a killed worker's job is
    # picked up by another once its lease runs out)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.once:
        worker.run_once()
        return EXIT_OK
    worker.run_forever(poll_seconds=args.poll_seconds, stop=stop, max_jobs=args.max_jobs)
    return EXIT_OK
