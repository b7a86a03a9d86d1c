"""The operations store: durable export operations and their event logs.

SQLite (a file, WAL mode) by default, PostgreSQL by URL; the schema is managed
by Alembic migrations (exporter/store/migrations), applied on open. Every
update is a compare-and-set on the row's ``version``, so concurrent workers
and API processes never overwrite each other: a lost race is detected, not
silently applied. Queue semantics (claim, lease, heartbeat, retry) live here
too, behind the same small interface, so a distributed queue can replace them.
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import threading
import time
from dataclasses import dataclass, fields
from typing import Callable
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import and_, create_engine, event, insert, or_, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from converters import errors as E
from converters.errors import ExportError

from .schema import operation_events, operations
from .util import aware, utcnow

STATUSES = ("queued", "running", "cancelling", "succeeded", "failed", "cancelled")
TERMINAL = {"succeeded", "failed", "cancelled"}
STAGES = ("fetching", "verifying", "converting", "publishing")
# status -> statuses it may move to
TRANSITIONS = {
    "queued": {"running", "cancelled"},
    "running": {"queued", "succeeded", "failed", "cancelling"},
    "cancelling": {"cancelled", "succeeded", "failed"},
}
MIGRATIONS = Path(__file__).parent / "migrations"


_aware = aware


def fingerprint(request: dict) -> str:
    return hashlib.sha256(json.dumps(request, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class Operation:
    id: str
    type: str
    status: str
    stage: str | None
    percent: float | None
    bytes_done: int | None
    bytes_total: int | None
    eta_seconds: float | None
    message: str | None
    request: dict
    result: dict | None
    error_code: str | None
    error_message: str | None
    attempts: int
    idempotency_key: str | None
    fingerprint: str
    run_id: str | None
    format: str | None
    worker_id: str | None
    lease_expires_at: datetime | None
    available_at: datetime
    version: int
    created_at: datetime
    started_at: datetime | None
    updated_at: datetime
    finished_at: datetime | None
    tenant: str | None = None
    checkpoint_id: str | None = None
    job_id: int | None = None

    @classmethod
    def from_row(cls, row) -> "Operation":
        d = dict(row._mapping)
        for k in ("lease_expires_at", "available_at", "created_at", "started_at", "updated_at", "finished_at"):
            d[k] = _aware(d[k])
        return cls(**{f.name: d[f.name] for f in fields(cls)})

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL

    def to_dict(self) -> dict:
        """The public shape (no lease internals)."""
        iso = lambda d: d.isoformat() if d else None  # noqa: E731
        return {
            "operation": self.id, "type": self.type, "status": self.status, "stage": self.stage,
            "progress": {"percent": self.percent, "bytes_done": self.bytes_done, "bytes_total": self.bytes_total, "eta_seconds": self.eta_seconds, "message": self.message},
            "format": self.format, "run_id": self.run_id, "checkpoint_id": self.checkpoint_id, "request": self.request, "result": self.result,
            "error": {"code": self.error_code, "message": self.error_message} if self.error_code else None,
            "attempts": self.attempts,
            "created_at": iso(self.created_at), "started_at": iso(self.started_at), "updated_at": iso(self.updated_at), "finished_at": iso(self.finished_at),
        }


@dataclass(frozen=True)
class Event:
    seq: int
    operation_id: str
    at: datetime
    kind: str
    data: dict | None


def sqlite_url(path: str | Path) -> str:
    return f"sqlite:///{Path(path).absolute()}"


class Store:
    def __init__(self, url: str, *, progress_interval: float = 1.0, migrate: bool = True):
        self.url = url
        self.engine: Engine = create_engine(url, future=True, pool_pre_ping=True)
        if self.engine.dialect.name == "sqlite":
            event.listen(self.engine, "connect", _sqlite_pragmas)
        self.progress_interval = progress_interval
        self._last_progress: dict[str, float] = {}
        self._lock = threading.Lock()
        if migrate:
            self.migrate()

    # --- schema -----------------------------------------------------------------------------

    def migrate(self) -> None:
        """Bring the schema to the newest Alembic revision."""
        from alembic import command
        from alembic.config import Config

        cfg = Config()
        cfg.set_main_option("script_location", str(MIGRATIONS))
        with self.engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")

    def schema_revision(self) -> str | None:
        from alembic.runtime.migration import MigrationContext

        with self.engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()

    def close(self) -> None:
        self.engine.dispose()

    # --- creating and reading ---------------------------------------------------------------

    def create(self, request: dict, *, idempotency_key: str | None = None, type: str = "export", tenant: str | None = None,
               in_tx: Callable | None = None) -> tuple[Operation, bool]:
        """(operation, created). The same Idempotency-Key with the same request returns the
        existing operation; with a different request it is refused. ``in_tx(conn, op_id)``
        runs in the inserting transaction (the distributed queue enqueues its job there)."""
        fp = fingerprint(request)
        if idempotency_key:
            existing = self._by_key(idempotency_key)
            if existing is not None:
                return self._same_request(existing, fp), False
        now = utcnow()
        op_id = "op_" + secrets.token_hex(12)
        row = {
            "id": op_id, "type": type, "status": "queued", "request": request, "attempts": 0, "idempotency_key": idempotency_key,
            "fingerprint": fp, "run_id": request.get("run_id"), "format": request.get("format"), "available_at": now, "version": 1,
            "created_at": now, "updated_at": now, "tenant": tenant, "checkpoint_id": request.get("checkpoint_id"),
        }
        try:
            with self.engine.begin() as conn:
                conn.execute(insert(operations).values(**row))
                conn.execute(insert(operation_events).values(operation_id=op_id, at=now, kind="created", data={"status": "queued"}))
                if in_tx is not None:
                    in_tx(conn, op_id)
        except IntegrityError:
            existing = self._by_key(idempotency_key) if idempotency_key else None
            if existing is None:
                raise
            return self._same_request(existing, fp), False  # a concurrent create with the same key won
        return self.get(op_id), True

    def _same_request(self, op: Operation, fp: str) -> Operation:
        if op.fingerprint != fp:
            raise ExportError(E.IDEMPOTENCY_CONFLICT, "this Idempotency-Key was already used with a different request; use a new key for a new export.", field="Idempotency-Key")
        return op

    def _by_key(self, key: str) -> Operation | None:
        with self.engine.connect() as conn:
            row = conn.execute(select(operations).where(operations.c.idempotency_key == key)).first()
        return Operation.from_row(row) if row else None

    def get(self, op_id: str, *, tenant: str | None = None) -> Operation:
        """``tenant``: only that tenant's operations exist (another's is "not found", never "forbidden")."""
        q = select(operations).where(operations.c.id == op_id)
        if tenant is not None:
            q = q.where(operations.c.tenant == tenant)
        with self.engine.connect() as conn:
            row = conn.execute(q).first()
        if row is None:
            raise ExportError(E.OPERATION_NOT_FOUND, f"operation {op_id} does not exist.", field="id")
        return Operation.from_row(row)

    def list(self, *, status: str | None = None, run_id: str | None = None, format: str | None = None, limit: int = 50, cursor: str | None = None,
             tenant: str | None = None, checkpoint_id: str | None = None, statuses: tuple[str, ...] | None = None) -> tuple[list[Operation], str | None]:
        """Newest first; ``cursor`` is the opaque token from the previous page."""
        q = select(operations)
        if tenant is not None:
            q = q.where(operations.c.tenant == tenant)
        if checkpoint_id is not None:
            q = q.where(operations.c.checkpoint_id == checkpoint_id)
        if statuses:
            q = q.where(operations.c.status.in_(statuses))
        if status:
            q = q.where(operations.c.status == status)
        if run_id:
            q = q.where(operations.c.run_id == run_id)
        if format:
            q = q.where(operations.c.format == format)
        if cursor:
            at, cid = _decode_cursor(cursor)
            q = q.where(or_(operations.c.created_at < at, and_(operations.c.created_at == at, operations.c.id < cid)))
        q = q.order_by(operations.c.created_at.desc(), operations.c.id.desc()).limit(limit + 1)
        with self.engine.connect() as conn:
            ops = [Operation.from_row(r) for r in conn.execute(q)]
        more = len(ops) > limit
        ops = ops[:limit]
        return ops, (_encode_cursor(ops[-1]) if more and ops else None)

    def events(self, op_id: str, after: int = 0) -> list[Event]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(operation_events).where(operation_events.c.operation_id == op_id, operation_events.c.seq > after).order_by(operation_events.c.seq))
            return [Event(r.seq, r.operation_id, _aware(r.at), r.kind, r.data) for r in rows]

    # --- changing ---------------------------------------------------------------------------

    def _cas(self, op: Operation, values: dict, event_kind: str | None = None, event_data: dict | None = None, in_tx: Callable | None = None) -> Operation | None:
        """Apply ``values`` if the row is still at ``op.version``; None when another writer got there first."""
        now = utcnow()
        with self.engine.begin() as conn:
            res = conn.execute(update(operations).where(operations.c.id == op.id, operations.c.version == op.version).values(**values, version=op.version + 1, updated_at=now))
            if res.rowcount != 1:
                return None
            if event_kind:
                conn.execute(insert(operation_events).values(operation_id=op.id, at=now, kind=event_kind, data=event_data))
            if in_tx is not None:
                in_tx(conn, op.id)
        return self.get(op.id)

    def transition(self, op_id: str, status: str, *, stage: str | None = None, result: dict | None = None, error: ExportError | None = None, worker_id: str | None = None,
                   retry_in: float | None = None, in_tx: Callable | None = None) -> Operation:
        """Move to ``status`` (validated against TRANSITIONS), recording an event; ``in_tx(conn, op_id)`` runs in the same transaction."""
        for _ in range(20):
            op = self.get(op_id)
            if status not in TRANSITIONS.get(op.status, set()):
                raise ExportError(E.INVALID_TRANSITION, f"operation {op_id} is {op.status} and cannot become {status}.", field="status")
            if worker_id is not None and op.worker_id not in (None, worker_id):
                raise ExportError(E.LEASE_LOST, f"operation {op_id} is now held by another worker.")
            values: dict = {"status": status}
            data: dict = {"from": op.status, "to": status}
            if stage is not None:
                values["stage"] = stage
            if result is not None:
                values["result"] = result
            if error is not None:
                values.update(error_code=error.code, error_message=error.message)
                data["error"] = error.code
            if status in TERMINAL:
                values.update(finished_at=utcnow(), worker_id=None, lease_expires_at=None)
            if status == "queued":  # a retry: back off, give up the lease
                values.update(worker_id=None, lease_expires_at=None, available_at=utcnow() + timedelta(seconds=retry_in or 0))
                data["retry_in"] = retry_in
            done = self._cas(op, values, "status", data, in_tx)
            if done is not None:
                return done
        raise ExportError(E.INTERNAL, f"operation {op_id} kept changing under us; giving up the transition to {status}.")

    def set_stage(self, op_id: str, stage: str, worker_id: str) -> Operation:
        for _ in range(20):
            op = self.get(op_id)
            if op.worker_id != worker_id:
                raise ExportError(E.LEASE_LOST, f"operation {op_id} is now held by another worker.")
            done = self._cas(op, {"stage": stage, "percent": None, "bytes_done": None, "bytes_total": None, "eta_seconds": None, "message": None}, "stage", {"stage": stage})
            if done is not None:
                return done
        raise ExportError(E.INTERNAL, f"operation {op_id} kept changing under us.")

    def append_event(self, op_id: str, kind: str, data: dict | None = None) -> None:
        with self.engine.begin() as conn:
            conn.execute(insert(operation_events).values(operation_id=op_id, at=utcnow(), kind=kind, data=data))

    def progress(self, op_id: str, *, bytes_done: int, bytes_total: int, eta_seconds: float | None = None, message: str | None = None, force: bool = False) -> bool:
        """Record progress at most once per ``progress_interval`` per operation (unless ``force``).

        Returns whether it was written. Never bumps ``version``: progress must not
        make a concurrent status change fail its compare-and-set.
        """
        now = time.monotonic()
        with self._lock:
            if not force and now - self._last_progress.get(op_id, -1e9) < self.progress_interval:
                return False
            self._last_progress[op_id] = now
        percent = round(100.0 * bytes_done / bytes_total, 2) if bytes_total else None
        with self.engine.begin() as conn:
            conn.execute(update(operations).where(operations.c.id == op_id).values(bytes_done=bytes_done, bytes_total=bytes_total, percent=percent, eta_seconds=eta_seconds, message=(message or None) and message[:500], updated_at=utcnow()))
        return True

    # --- the queue --------------------------------------------------------------------------

    def claim(self, worker_id: str, *, lease_seconds: float = 60, max_attempts: int = 3) -> Operation | None:
        """Take the oldest runnable operation: queued and due, or running with an expired lease
        (its worker died). Leases an operation to exactly one worker; exhausted ones fail."""
        while True:
            now = utcnow()
            q = (select(operations)
                 .where(or_(and_(operations.c.status == "queued", operations.c.available_at <= now),
                            and_(operations.c.status.in_(("running", "cancelling")), operations.c.lease_expires_at < now)))
                 .order_by(operations.c.created_at, operations.c.id).limit(8))
            with self.engine.connect() as conn:
                candidates = [Operation.from_row(r) for r in conn.execute(q)]
            if not candidates:
                return None
            for op in candidates:
                taken, _closed = self._take(op, worker_id, lease_seconds=lease_seconds, max_attempts=max_attempts, reason="lease expired")
                if taken is not None:
                    return taken

    def claim_operation(self, op_id: str, worker_id: str, *, lease_seconds: float = 60, max_attempts: int = 3) -> Operation | None:
        """Take one given operation (the distributed queue handed us its job). A running one is
        taken over: the queue only hands out a job again when its worker stopped. None when
        there is nothing to run (finished, or cancelled meanwhile)."""
        for _ in range(20):
            op = self.get(op_id)
            if op.finished:
                return None
            taken, closed = self._take(op, worker_id, lease_seconds=lease_seconds, max_attempts=max_attempts, reason="worker stopped")
            if taken is not None or closed:
                return taken
        return None

    def _take(self, op: Operation, worker_id: str, *, lease_seconds: float, max_attempts: int, reason: str) -> tuple[Operation | None, bool]:
        """Lease ``op`` to ``worker_id``: (the leased operation, False). An operation that must not run
        again is closed instead, giving (None, True): cancelling becomes cancelled, one whose attempts
        are used up fails. (None, False): another writer changed it first."""
        now = utcnow()
        closed = {"finished_at": now, "worker_id": None, "lease_expires_at": None}
        if op.status == "cancelling":  # cancelled while its worker was dying
            self._cas(op, {"status": "cancelled", **closed}, "status", {"from": "cancelling", "to": "cancelled", "reason": reason})
            return None, True
        if op.attempts >= max_attempts:
            self._cas(op, {"status": "failed", **closed, "error_code": E.ATTEMPTS_EXHAUSTED,
                           "error_message": f"the export failed on all {max_attempts} attempts; the last worker stopped without finishing."},
                      "status", {"from": op.status, "to": "failed", "error": E.ATTEMPTS_EXHAUSTED})
            return None, True
        taken = self._cas(op, {"status": "running", "worker_id": worker_id, "lease_expires_at": now + timedelta(seconds=lease_seconds),
                               "attempts": op.attempts + 1, "started_at": op.started_at or now},
                          "claimed", {"worker": worker_id, "attempt": op.attempts + 1, "reclaimed": op.status == "running"})
        return taken, False

    def heartbeat(self, op_id: str, worker_id: str, *, lease_seconds: float = 60) -> Operation:
        """Extend the lease; raises lease_lost if another worker took the operation over."""
        with self.engine.begin() as conn:
            res = conn.execute(update(operations).where(operations.c.id == op_id, operations.c.worker_id == worker_id, operations.c.status.in_(("running", "cancelling")))
                               .values(lease_expires_at=utcnow() + timedelta(seconds=lease_seconds)))
        if res.rowcount != 1:
            raise ExportError(E.LEASE_LOST, f"operation {op_id} is no longer leased to worker {worker_id}.")
        return self.get(op_id)

    def cancel(self, op_id: str) -> Operation:
        """Queued: cancelled at once. Running: cancelling (its worker stops and confirms)."""
        op = self.get(op_id)
        if op.finished or op.status == "cancelling":
            return op
        return self.transition(op_id, "cancelled" if op.status == "queued" else "cancelling")


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA busy_timeout=10000")
    cur.close()


def _encode_cursor(op: Operation) -> str:
    return base64.urlsafe_b64encode(f"{op.created_at.isoformat()}|{op.id}".encode()).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        at, cid = raw.split("|", 1)
        return datetime.fromisoformat(at), cid
    except (ValueError, UnicodeDecodeError):
        raise ExportError(E.INVALID_OPTION, "the pagination cursor is not valid; start again without one.", field="cursor") from None
