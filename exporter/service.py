"""The running service's parts, built once from Settings: stores, artifacts, webhooks, background loops.

``serve`` and ``demo`` build one of these; the API reads it from the app's
state. Background loops (in-process export workers, the webhook dispatcher,
the checkpoint sweeper) start with ``start()`` and stop with ``stop()``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading

from .crypto import SecretBox
from .settings import Settings
from .store import Store
from .store.checkpoints import Checkpoints
from .store.idempotency import IdempotencyKeys
from .store.keys import ApiKeys
from .store.rules import ExportRules
from .store.webhooks import Webhooks
from .webhooks import Dispatcher, parse_networks

log = logging.getLogger("nucleus_export.service")


class Services:
    def __init__(self, settings: Settings, *, artifacts=None):
        self.settings = settings
        self.store = Store(settings.store_url())
        engine = self.store.engine
        self.keys = ApiKeys(engine)
        self.idempotency = IdempotencyKeys(engine, retention_seconds=settings.idempotency_retention_seconds)
        self.checkpoints = Checkpoints(engine)
        self.rules = ExportRules(engine)
        self.webhooks = Webhooks(engine)
        self.artifacts = artifacts if artifacts is not None else settings.artifacts()
        from .queue import build_queue

        self.queue = build_queue(settings, self.store)
        self.box = SecretBox(settings.secret_key_bytes())
        self.allowed_networks = parse_networks(settings.webhook_allowed_networks)
        self.dispatcher = Dispatcher(self.store, self.webhooks, self.box, schedule=settings.retry_schedule(), timeout=settings.webhook_timeout_seconds,
                                     allowed_networks=self.allowed_networks, poll_seconds=0.5)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.workers = []

    def start(self, *, workers: int | None = None, dispatcher: bool = True, sweeper: bool = True) -> None:
        from .runner import Worker
        from .sweeper import Sweeper

        n = self.settings.workers if workers is None else workers
        if n and self.queue.name == "procrastinate":
            self._spawn("workers", lambda: self.queue.run_workers(self.make_worker, concurrency=n, heartbeat_seconds=self.settings.heartbeat_seconds,
                                                                  stop=self._stop))
        else:
            for i in range(n):
                w = Worker(self.store, self.artifacts, self.settings.runner_config(), f"{socket.gethostname()}:{os.getpid()}:{i}", self.queue)
                self.workers.append(w)
                self._spawn(f"worker-{i}", lambda w=w: w.run_forever(poll_seconds=0.5, stop=self._stop))
        if dispatcher:
            self._spawn("webhooks", lambda: self.dispatcher.run(self._stop))
        if sweeper:
            sw = Sweeper(self)
            self._spawn("sweeper", lambda: sw.run(self._stop, self.settings.sweep_interval_seconds))

    def make_worker(self):
        """A runner for one job of the distributed queue (each job gets its own: a runner holds one job's state)."""
        from .runner import Worker

        return Worker(self.store, self.artifacts, self.settings.runner_config(), f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}", self.queue)

    def _spawn(self, name: str, fn) -> None:
        t = threading.Thread(target=fn, name=f"nucleus-{name}", daemon=True)
        t.start()
        self._threads.append(t)

    def stop(self, timeout: float = 30.0) -> None:
        """Ask every loop to stop; a worker finishes its current job first (or its lease hands it on)."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout)
        self._threads.clear()

    def close(self) -> None:
        self.stop()
        self.store.close()
