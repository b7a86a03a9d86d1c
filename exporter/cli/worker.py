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
    from ..runner import Worker
    from ..store import Store

    store = Store(settings.store_url())
    return Worker(store, settings.artifacts(), settings.runner_config(), worker_id or f"{socket.gethostname()}:{os.getpid()}")


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
