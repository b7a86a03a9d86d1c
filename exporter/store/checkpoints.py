"""Registered checkpoint archives: where each lives, its base model and step, and when it expires."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import and_, insert, select, update
from sqlalchemy.exc import IntegrityError

from converters import errors as E
from converters.errors import ExportError

from .schema import checkpoints as T
from .util import aware, utcnow


@dataclass(frozen=True)
class Checkpoint:
    tenant: str
    run_id: str
    checkpoint_id: str
    uri: str
    sha256: str | None
    size: int | None
    base_model: str | None
    step: int | None
    created_at: datetime
    expires_at: datetime | None
    expiring_notified_at: datetime | None
    deleted_at: datetime | None

    @property
    def ref(self) -> str:
        return f"nucleus://{self.run_id}/{self.checkpoint_id}"

    def to_dict(self) -> dict:
        iso = lambda d: d.isoformat() if d else None  # noqa: E731
        return {"run_id": self.run_id, "checkpoint_id": self.checkpoint_id, "checkpoint": self.ref, "uri": self.uri, "sha256": self.sha256, "size": self.size,
                "base_model": self.base_model, "step": self.step, "created_at": iso(self.created_at), "expires_at": iso(self.expires_at),
                "deleted": self.deleted_at is not None}


def _row(r) -> Checkpoint:
    d = dict(r._mapping)
    for k in ("created_at", "expires_at", "expiring_notified_at", "deleted_at"):
        d[k] = aware(d[k])
    return Checkpoint(**d)


class Checkpoints:
    def __init__(self, engine):
        self.engine = engine

    def register(self, tenant: str, run_id: str, checkpoint_id: str, *, uri: str, sha256: str | None = None, size: int | None = None,
                 base_model: str | None = None, step: int | None = None, ttl_seconds: int | None = None) -> tuple[Checkpoint, bool]:
        """(checkpoint, created). Registering the same archive again is a no-op; another archive under the same id is refused."""
        now = utcnow()
        values = dict(tenant=tenant, run_id=run_id, checkpoint_id=checkpoint_id, uri=uri, sha256=sha256, size=size, base_model=base_model, step=step,
                      created_at=now, expires_at=now + timedelta(seconds=ttl_seconds) if ttl_seconds else None)
        try:
            with self.engine.begin() as conn:
                conn.execute(insert(T).values(**values))
            return self.get(tenant, run_id, checkpoint_id), True
        except IntegrityError:
            existing = self.get(tenant, run_id, checkpoint_id, include_deleted=True)
            if existing.uri != uri or (sha256 and existing.sha256 and existing.sha256 != sha256):
                raise ExportError(E.CHECKPOINT_EXISTS, f"checkpoint {checkpoint_id} of {run_id} is already registered with another archive; register it under a new id.", field="checkpoint_id") from None
            return existing, False

    def _lookup(self, conn, tenant: str, run_id: str, checkpoint_id: str):
        rows = conn.execute(select(T).where(T.c.tenant == tenant, T.c.run_id == run_id, T.c.checkpoint_id == checkpoint_id)).all()
        if not rows and "/" not in checkpoint_id:
            # "000240" names "sampler_weights/000240" when that is the only match
            rows = conn.execute(select(T).where(T.c.tenant == tenant, T.c.run_id == run_id, T.c.checkpoint_id.endswith("/" + checkpoint_id, autoescape=True))).all()
        return rows

    def get(self, tenant: str, run_id: str, checkpoint_id: str, *, include_deleted: bool = False) -> Checkpoint:
        with self.engine.connect() as conn:
            rows = self._lookup(conn, tenant, run_id, checkpoint_id)
        if len(rows) != 1:
            why = "is ambiguous; give its full id (e.g. sampler_weights/000240)" if rows else "is not registered; register it with POST /v1/training-runs/{run}/checkpoints"
            raise ExportError(E.CHECKPOINT_NOT_FOUND, f"checkpoint {checkpoint_id} of run {run_id} {why}.", field="checkpoint_id")
        ck = _row(rows[0])
        if ck.deleted_at and not include_deleted:
            raise ExportError(E.CHECKPOINT_DELETED, f"checkpoint {ck.checkpoint_id} of run {run_id} expired and its archive was deleted; register it again to export it.", field="checkpoint_id")
        return ck

    def list(self, tenant: str, run_id: str) -> list[Checkpoint]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(T).where(T.c.tenant == tenant, T.c.run_id == run_id).order_by(T.c.step, T.c.checkpoint_id)).all()
        return [_row(r) for r in rows]

    def set_expiry(self, tenant: str, run_id: str, checkpoint_id: str, ttl_seconds: int | None) -> Checkpoint:
        ck = self.get(tenant, run_id, checkpoint_id)
        expires = utcnow() + timedelta(seconds=ttl_seconds) if ttl_seconds is not None else None
        with self.engine.begin() as conn:
            conn.execute(update(T).where(T.c.tenant == tenant, T.c.run_id == run_id, T.c.checkpoint_id == ck.checkpoint_id)
                         .values(expires_at=expires, expiring_notified_at=None))
        return self.get(tenant, run_id, ck.checkpoint_id)

    def expired(self, now: datetime) -> list[Checkpoint]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(T).where(T.c.deleted_at.is_(None), T.c.expires_at.is_not(None), T.c.expires_at <= now)).all()
        return [_row(r) for r in rows]

    def expiring(self, now: datetime, window: timedelta) -> list[Checkpoint]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(T).where(T.c.deleted_at.is_(None), T.c.expiring_notified_at.is_(None), T.c.expires_at.is_not(None),
                                                and_(T.c.expires_at > now, T.c.expires_at <= now + window))).all()
        return [_row(r) for r in rows]

    def _mark(self, ck: Checkpoint, **values) -> bool:
        with self.engine.begin() as conn:
            return conn.execute(update(T).where(T.c.tenant == ck.tenant, T.c.run_id == ck.run_id, T.c.checkpoint_id == ck.checkpoint_id,
                                                T.c.expires_at == ck.expires_at).values(**values)).rowcount == 1

    def mark_deleted(self, ck: Checkpoint) -> bool:
        """False when its expiry changed meanwhile (then it is not deleted)."""
        return self._mark(ck, deleted_at=utcnow())

    def mark_notified(self, ck: Checkpoint) -> bool:
        return self._mark(ck, expiring_notified_at=utcnow())

    def unmark_deleted(self, ck: Checkpoint) -> None:
        with self.engine.begin() as conn:
            conn.execute(update(T).where(T.c.tenant == ck.tenant, T.c.run_id == ck.run_id, T.c.checkpoint_id == ck.checkpoint_id).values(deleted_at=None))
