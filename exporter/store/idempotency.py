"""Idempotency-Key records, after the IETF httpapi draft (draft-ietf-httpapi-idempotency-key-header).

A key is scoped to its tenant and kept for ``retention`` (24 h by default).
The first request with a key inserts a ``processing`` row; the primary key
makes that insert the one place where concurrent requests race, so exactly one
wins. The others see: the same fingerprint and a finished response → that
response replayed; still processing → 409; a different fingerprint → 422.
Only successful responses are kept: after an error the row is removed, so the
client may retry with the same key. A ``processing`` row older than
``stale_after`` belonged to a process that died mid-request and is taken over.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import delete, insert, select, update
from sqlalchemy.exc import IntegrityError

from converters import errors as E
from converters.errors import ExportError

from .schema import idempotency_keys as T
from .util import aware, utcnow


@dataclass(frozen=True)
class Replay:
    status_code: int
    body: dict
    headers: dict


class IdempotencyKeys:
    def __init__(self, engine, *, retention_seconds: float = 24 * 3600, stale_after_seconds: float = 300):
        self.engine = engine
        self.retention = timedelta(seconds=retention_seconds)
        self.stale_after = timedelta(seconds=stale_after_seconds)

    def begin(self, tenant: str, key: str, fingerprint: str) -> Replay | None:
        """None: this request owns the key now (call ``finish`` or ``abandon``). A Replay: answer with it."""
        if not key or len(key) > 255:
            raise ExportError(E.VALIDATION_FAILED, "the Idempotency-Key header must be 1 to 255 characters.", field="Idempotency-Key")
        for _ in range(5):
            now = utcnow()
            try:
                with self.engine.begin() as conn:
                    conn.execute(insert(T).values(tenant=tenant, key=key, fingerprint=fingerprint, state="processing", created_at=now, expires_at=now + self.retention))
                return None
            except IntegrityError:
                pass
            with self.engine.connect() as conn:
                row = conn.execute(select(T).where(T.c.tenant == tenant, T.c.key == key)).first()
            if row is None:
                continue  # removed meanwhile (abandoned or expired): try again
            if aware(row.expires_at) <= now:
                self._delete_if(tenant, key, row.created_at)
                continue
            if row.fingerprint != fingerprint:
                raise ExportError(E.IDEMPOTENCY_CONFLICT, "this Idempotency-Key was already used with a different request; use a new key for a new request.", field="Idempotency-Key")
            if row.state == "done":
                return Replay(row.status_code, row.body, row.headers or {})
            if aware(row.created_at) < now - self.stale_after:
                with self.engine.begin() as conn:  # its owner died mid-request: take it over (one taker wins)
                    taken = conn.execute(update(T).where(T.c.tenant == tenant, T.c.key == key, T.c.state == "processing", T.c.created_at == row.created_at)
                                         .values(created_at=now)).rowcount
                if taken:
                    return None
                continue
            raise ExportError(E.IDEMPOTENCY_IN_PROGRESS, "a request with this Idempotency-Key is still being processed; retry after it finishes.", field="Idempotency-Key")
        raise ExportError(E.IDEMPOTENCY_IN_PROGRESS, "this Idempotency-Key is busy; retry shortly.", field="Idempotency-Key")

    def finish(self, tenant: str, key: str, status_code: int, body: dict, headers: dict) -> None:
        with self.engine.begin() as conn:
            conn.execute(update(T).where(T.c.tenant == tenant, T.c.key == key).values(state="done", status_code=status_code, body=body, headers=headers))

    def abandon(self, tenant: str, key: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(delete(T).where(T.c.tenant == tenant, T.c.key == key, T.c.state == "processing"))

    def _delete_if(self, tenant: str, key: str, created_at) -> None:
        with self.engine.begin() as conn:
            conn.execute(delete(T).where(T.c.tenant == tenant, T.c.key == key, T.c.created_at == created_at))

    def purge(self) -> int:
        """Forget keys past their retention."""
        with self.engine.begin() as conn:
            return conn.execute(delete(T).where(T.c.expires_at <= utcnow())).rowcount
