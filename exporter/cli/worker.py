"""``nucleus-export worker``: run export jobs until stopped.

Embedded queue (SQLite, or PostgreSQL with NUCLEUS_EXPORT_QUEUE=embedded): the
worker claims rows of the operations table. Distributed (PostgreSQL): a
procrastinate worker runs the jobs, ``--concurrency`` at a time.
"""

from __future__ import annotations

import os
import signal
import socket
import threading

from converters.errors import EXIT_OK

from ..settings import Settings
from ..settings import redact_url as _redact
from .errors import guarded
from .serve import settings_from


def register(sub) -> None:
    p = sub.add_parser("worker", help="run queued export jobs (SQLite by default; PostgreSQL and procrastinate with --db postgresql://…)")
    p.add_argument("--db", help="operations store URL (default NUCLEUS_EXPORT_DATABASE_URL, or SQLite in the data directory)")
    p.add_argument("--store", help="artifact store: s3://bucket/prefix (default a local folder in the data directory)")
    p.add_argument("--concurrency", type=int, default=1, help="exports at once in this process (default 1: one CPU-heavy conversion)")
    p.add_argument("--once", action="store_true", help="embedded queue: run at most one job, then exit")
    p.add_argument("--max-jobs", type=int, help="embedded queue: exit after this many jobs")
    p.add_argument("--poll-seconds", type=float, default=1.0)
    p.add_argument("--shutdown-timeout", type=float, default=None,
                   help="distributed queue: on SIGTERM, seconds to let running exports finish before handing them back (default: wait)")
    p.set_defaults(func=run, host=None, port=None)


def build_worker(settings: Settings, worker_id: str | None = None, queue=None):
    from ..runner import Worker
    from ..store import Store

    store = Store(settings.store_url())
    return Worker(store, settings.artifacts(), settings.runner_config(), worker_id or f"{socket.gethostname()}:{os.getpid()}", queue)


@guarded
def run(args) -> int:
    settings = settings_from(args)
    from ..queue import build_queue
    from ..store import Store

    store = Store(settings.store_url())
    queue = build_queue(settings, store)
    if queue.name == "procrastinate":
        artifacts = settings.artifacts()

        def make_worker():
            from ..runner import Worker

            return Worker(store, artifacts, settings.runner_config(), f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}", queue)

        print(f"nucleus-export worker: procrastinate queue on {_redact(settings.store_url())}, concurrency {args.concurrency}", flush=True)
        # procrastinate handles SIGTERM/SIGINT: no new jobs; running ones finish (or are handed back after --shutdown-timeout)
        queue.run_workers(make_worker, concurrency=args.concurrency, heartbeat_seconds=settings.heartbeat_seconds, shutdown_timeout=args.shutdown_timeout)
        return EXIT_OK
    worker = build_worker(settings, queue=queue)
    stop = threading.Event()
    # SIGTERM/SIGINT: finish the current job, then stop (a killed worker's job is
    # picked up by another once its lease runs out)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.once:
        worker.run_once()
        return EXIT_OK
    threads = [threading.Thread(target=build_worker(settings, f"{worker.worker_id}:{i}", queue).run_forever if i else worker.run_forever,
                                kwargs={"poll_seconds": args.poll_seconds, "stop": stop, "max_jobs": args.max_jobs}) for i in range(max(1, args.concurrency))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return EXIT_OK
