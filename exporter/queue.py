"""How an accepted export reaches a worker.

- ``EmbeddedQueue``: the operations table is the queue. Workers claim due rows
  (``Store.claim``) with leases and heartbeats; retries wait on the row's
  ``available_at``. SQLite (the default) or PostgreSQL, one machine or several.
- ``ProcrastinateQueue``: the distributed mode, on PostgreSQL. procrastinate's
  job tables live in the same database; an operation's job is inserted in the
  same transaction as the operation row (and a retry's job in the same
  transaction as its move back to ``queued``), so an accepted export is never
  lost and never enqueued twice. Workers on any machine run
  ``nucleus-export worker --db postgresql://…``; procrastinate's worker
  heartbeats and a periodic task that retries the jobs of stalled workers bring
  a crashed worker's export back; cancelling aborts the job through
  procrastinate, which reaches the conversion child on whichever machine runs it.

Both expose the same small interface to the store's callers: ``on_create`` and
``on_requeue`` (run inside the store's transaction), ``cancel``, ``run_workers``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import threading

from sqlalchemy import text, update

from .store import Operation, Store
from .store.schema import operations

log = logging.getLogger("nucleus_export.queue")

TASK = "nucleus_export.run_export"
QUEUE = "exports"


class EmbeddedQueue:
    name = "embedded"

    def on_create(self, conn, op_id: str) -> None:
        pass  # the row itself is the queue entry

    def on_requeue(self, delay: float):
        return None  # the row's available_at holds the retry back

    def cancel(self, op: Operation) -> None:
        pass  # the running worker's heartbeat sees the status change


def libpq_url(sqlalchemy_url: str) -> str:
    return sqlalchemy_url.replace("postgresql+psycopg://", "postgresql://", 1)


class ProcrastinateQueue:
    name = "procrastinate"

    def __init__(self, database_url: str, *, stalled_seconds: float = 30.0):
        import procrastinate

        if not database_url.startswith("postgresql"):
            raise ValueError("the distributed queue needs PostgreSQL (NUCLEUS_EXPORT_DATABASE_URL=postgresql+psycopg://…)")
        self.database_url = database_url
        self.stalled_seconds = stalled_seconds
        self.app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=libpq_url(database_url)))
        self._register_tasks()

    # --- schema -----------------------------------------------------------------------------

    def ensure_schema(self, store: Store) -> None:
        """Install procrastinate's tables once (an advisory lock keeps concurrent starters in line)."""
        from procrastinate.schema import SchemaManager

        with store.engine.begin() as conn:
            conn.execute(text("SELECT pg_advisory_xact_lock(4233120019)"))
            exists = conn.execute(text("SELECT to_regclass('procrastinate_jobs') IS NOT NULL")).scalar()
            if not exists:
                conn.exec_driver_sql(SchemaManager.get_schema().replace("%", "%%"))

    # --- enqueueing, inside the store's transactions -------------------------------------------

    def _defer(self, conn, op_id: str, delay: float = 0.0) -> None:
        job_id = conn.execute(text(
            "SELECT (procrastinate_defer_jobs_v1(ARRAY[ROW(:queue, :task, 0, NULL, NULL, CAST(:args AS jsonb), "
            "CASE WHEN :delay > 0 THEN now() + make_interval(secs => :delay) END)::procrastinate_job_to_defer_v1]))[1]"),
            {"queue": QUEUE, "task": TASK, "args": json.dumps({"operation_id": op_id}), "delay": float(delay)}).scalar_one()
        conn.execute(update(operations).where(operations.c.id == op_id).values(job_id=job_id))

    def on_create(self, conn, op_id: str) -> None:
        self._defer(conn, op_id)

    def on_requeue(self, delay: float):
        return lambda conn, op_id: self._defer(conn, op_id, delay)

    def cancel(self, op: Operation) -> None:
        if op.job_id is None:
            return
        with self.app.open():
            # a job not started yet is cancelled; a running one is asked to abort (its worker polls for that)
            self.app.job_manager.cancel_job_by_id(op.job_id, abort=True)

    # --- the worker side --------------------------------------------------------------------

    def _register_tasks(self) -> None:
        app = self.app
        queue = self

        @app.task(name=TASK, queue=QUEUE, pass_context=True)
        def run_export(context, operation_id: str) -> None:
            runner = queue.runner_factory()
            runner.run_operation(operation_id, abort=context.should_abort, shutting_down=lambda: _is_shutdown(context))

        @app.periodic(cron="* * * * * */5", periodic_id="retry-stalled")
        @app.task(name="nucleus_export.retry_stalled_jobs", queue=QUEUE, queueing_lock="retry-stalled", pass_context=False)
        async def retry_stalled_jobs(timestamp: int) -> None:
            # a job whose worker stopped heartbeating goes back to the queue; its operation resumes
            # at the first incomplete stage on whichever worker takes it
            for job in await app.job_manager.get_stalled_jobs(seconds_since_heartbeat=queue.stalled_seconds):
                log.warning("job %s (%s) stalled: its worker stopped; retrying it", job.id, job.task_kwargs)
                await app.job_manager.retry_job(job)

    runner_factory = None  # set by run_workers: () -> runner.Worker

    def run_workers(self, make_worker, *, concurrency: int = 1, name: str | None = None, heartbeat_seconds: float = 10.0,
                    install_signal_handlers: bool = True, shutdown_timeout: float | None = None, stop: threading.Event | None = None) -> None:
        """Run a procrastinate worker in this thread until stopped: by SIGTERM/SIGINT (with signal
        handlers) or by ``stop`` (embedded in ``serve``). Running exports get ``shutdown_timeout``
        seconds to finish, then are handed back to the queue."""
        self.runner_factory = make_worker
        options = dict(queues=[QUEUE], concurrency=concurrency, name=name or f"{socket.gethostname()}:{os.getpid()}",
                       update_heartbeat_interval=heartbeat_seconds, stalled_worker_timeout=self.stalled_seconds,
                       install_signal_handlers=install_signal_handlers and stop is None, shutdown_graceful_timeout=shutdown_timeout,
                       listen_notify=True, abort_job_polling_interval=1.0, fetch_job_polling_interval=1.0, delete_jobs="successful")
        if stop is None:
            self.app.run_worker(**options)
            return

        async def until_stopped() -> None:
            async with self.app.open_async():
                worker = asyncio.create_task(self.app.run_worker_async(**options))
                while not stop.is_set() and not worker.done():
                    await asyncio.sleep(0.2)
                if not worker.done():
                    worker.cancel()  # procrastinate's graceful stop: no new jobs, running ones finish or are aborted
                    with contextlib.suppress(asyncio.CancelledError):
                        await worker

        asyncio.run(until_stopped())


def _is_shutdown(context) -> bool:
    from procrastinate.job_context import AbortReason

    return context.abort_reason() == AbortReason.SHUTDOWN


def build_queue(settings, store: Store):
    """The queue these settings ask for: procrastinate when configured (PostgreSQL only), else embedded."""
    if settings.queue == "procrastinate" or (settings.queue == "auto" and (settings.database_url or "").startswith("postgresql")):
        q = ProcrastinateQueue(settings.store_url(), stalled_seconds=settings.stalled_seconds)
        q.ensure_schema(store)
        return q
    return EmbeddedQueue()

