"""Webhook endpoints, the deliveries owed to them, and every attempt made (the delivery log).

A delivery is unique per (endpoint, source): ``source`` names what caused it
(``op-event:<seq>``, ``checkpoint-expiring:<…>``), so fanning the same event
out twice — two dispatchers, a restart — inserts it once. Sending is claimed
with a short lease, so one delivery is in flight from one process at a time.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import and_, delete, insert, or_, select, update

from converters import errors as E
from converters.errors import ExportError

from .schema import dispatch_cursor, webhook_attempts, webhook_deliveries, webhook_endpoints
from .util import aware, insert_ignore, utcnow


@dataclass(frozen=True)
class Endpoint:
    id: str
    tenant: str
    url: str
    events: list[str]
    secret_enc: str
    enabled: bool
    disabled_reason: str | None
    created_at: datetime

    def to_dict(self) -> dict:
        return {"id": self.id, "url": self.url, "events": self.events, "enabled": self.enabled, "disabled_reason": self.disabled_reason,
                "created_at": self.created_at.isoformat()}


@dataclass(frozen=True)
class Delivery:
    id: str
    endpoint_id: str
    source: str
    event_type: str
    payload: dict
    status: str
    attempts: int
    next_attempt_at: datetime | None
    lease_until: datetime | None
    last_status_code: int | None
    last_error: str | None
    created_at: datetime
    updated_at: datetime

    def to_dict(self) -> dict:
        iso = lambda d: d.isoformat() if d else None  # noqa: E731
        return {"id": self.id, "endpoint_id": self.endpoint_id, "event_type": self.event_type, "status": self.status, "attempts": self.attempts,
                "next_attempt_at": iso(self.next_attempt_at), "last_status_code": self.last_status_code, "last_error": self.last_error,
                "created_at": iso(self.created_at), "updated_at": iso(self.updated_at), "payload": self.payload}


def _endpoint(r) -> Endpoint:
    d = dict(r._mapping)
    d["enabled"], d["created_at"] = bool(d["enabled"]), aware(d["created_at"])
    return Endpoint(**d)


def _delivery(r) -> Delivery:
    d = dict(r._mapping)
    for k in ("next_attempt_at", "lease_until", "created_at", "updated_at"):
        d[k] = aware(d[k])
    return Delivery(**d)


class Webhooks:
    def __init__(self, engine):
        self.engine = engine

    # --- endpoints --------------------------------------------------------------------------

    def create_endpoint(self, tenant: str, url: str, events: list[str], secret_enc: str) -> Endpoint:
        ep_id = "we_" + secrets.token_hex(8)
        with self.engine.begin() as conn:
            conn.execute(insert(webhook_endpoints).values(id=ep_id, tenant=tenant, url=url, events=sorted(set(events)), secret_enc=secret_enc, enabled=1, created_at=utcnow()))
        return self.get_endpoint(tenant, ep_id)

    def get_endpoint(self, tenant: str | None, ep_id: str) -> Endpoint:
        q = select(webhook_endpoints).where(webhook_endpoints.c.id == ep_id)
        if tenant is not None:
            q = q.where(webhook_endpoints.c.tenant == tenant)
        with self.engine.connect() as conn:
            r = conn.execute(q).first()
        if r is None:
            raise ExportError(E.WEBHOOK_NOT_FOUND, f"webhook endpoint {ep_id} does not exist.", field="webhook_id")
        return _endpoint(r)

    def list_endpoints(self, tenant: str) -> list[Endpoint]:
        with self.engine.connect() as conn:
            return [_endpoint(r) for r in conn.execute(select(webhook_endpoints).where(webhook_endpoints.c.tenant == tenant).order_by(webhook_endpoints.c.created_at))]

    def endpoints_for(self, tenant: str, event_type: str) -> list[Endpoint]:
        return [e for e in self.list_endpoints(tenant) if e.enabled and event_type in e.events]

    def delete_endpoint(self, tenant: str, ep_id: str) -> None:
        with self.engine.begin() as conn:
            if conn.execute(delete(webhook_endpoints).where(webhook_endpoints.c.tenant == tenant, webhook_endpoints.c.id == ep_id)).rowcount != 1:
                raise ExportError(E.WEBHOOK_NOT_FOUND, f"webhook endpoint {ep_id} does not exist.", field="webhook_id")

    def disable(self, ep_id: str, reason: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(update(webhook_endpoints).where(webhook_endpoints.c.id == ep_id).values(enabled=0, disabled_reason=reason[:200]))
            conn.execute(update(webhook_deliveries).where(webhook_deliveries.c.endpoint_id == ep_id, webhook_deliveries.c.status == "pending")
                         .values(status="failed", last_error=f"endpoint disabled: {reason}"[:500], updated_at=utcnow()))

    # --- deliveries -------------------------------------------------------------------------

    def enqueue(self, endpoint_id: str, source: str, event_type: str, payload: dict) -> bool:
        """Whether it was new (False: this source was already fanned out to this endpoint)."""
        now = utcnow()
        with self.engine.begin() as conn:
            return conn.execute(insert_ignore(self.engine, webhook_deliveries).values(
                id="msg_" + secrets.token_hex(12), endpoint_id=endpoint_id, source=source, event_type=event_type, payload=payload,
                status="pending", attempts=0, next_attempt_at=now, created_at=now, updated_at=now)).rowcount == 1

    def claim_due(self, *, lease_seconds: float = 60, limit: int = 20) -> list[Delivery]:
        now = utcnow()
        D = webhook_deliveries
        with self.engine.connect() as conn:
            rows = conn.execute(select(D).where(D.c.status == "pending", D.c.next_attempt_at <= now, or_(D.c.lease_until.is_(None), D.c.lease_until < now))
                                .order_by(D.c.next_attempt_at).limit(limit)).all()
        claimed = []
        for r in rows:
            with self.engine.begin() as conn:
                ok = conn.execute(update(D).where(D.c.id == r.id, D.c.status == "pending", or_(D.c.lease_until.is_(None), D.c.lease_until == r.lease_until))
                                  .values(lease_until=now + timedelta(seconds=lease_seconds))).rowcount == 1
            if ok:
                claimed.append(self.get_delivery(r.id))
        return claimed

    def record_attempt(self, d: Delivery, *, status_code: int | None, error: str | None, duration_ms: int, outcome: str, next_attempt_at: datetime | None = None) -> None:
        """``outcome``: succeeded, failed, or pending (retry at ``next_attempt_at``)."""
        now = utcnow()
        with self.engine.begin() as conn:
            conn.execute(insert(webhook_attempts).values(delivery_id=d.id, at=now, status_code=status_code, error=(error or None) and error[:500], duration_ms=duration_ms))
            conn.execute(update(webhook_deliveries).where(webhook_deliveries.c.id == d.id).values(
                status=outcome, attempts=d.attempts + 1, next_attempt_at=next_attempt_at, lease_until=None, last_status_code=status_code,
                last_error=(error or None) and error[:500], updated_at=now))

    def get_delivery(self, delivery_id: str, endpoint_id: str | None = None) -> Delivery:
        q = select(webhook_deliveries).where(webhook_deliveries.c.id == delivery_id)
        if endpoint_id:
            q = q.where(webhook_deliveries.c.endpoint_id == endpoint_id)
        with self.engine.connect() as conn:
            r = conn.execute(q).first()
        if r is None:
            raise ExportError(E.WEBHOOK_NOT_FOUND, f"delivery {delivery_id} does not exist.", field="delivery_id")
        return _delivery(r)

    def deliveries(self, endpoint_id: str, limit: int = 100) -> list[Delivery]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(webhook_deliveries).where(webhook_deliveries.c.endpoint_id == endpoint_id)
                                .order_by(webhook_deliveries.c.created_at.desc()).limit(limit)).all()
        return [_delivery(r) for r in rows]

    def attempts(self, delivery_id: str) -> list[dict]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(webhook_attempts).where(webhook_attempts.c.delivery_id == delivery_id).order_by(webhook_attempts.c.seq)).all()
        return [{"at": aware(r.at).isoformat(), "status_code": r.status_code, "error": r.error, "duration_ms": r.duration_ms} for r in rows]

    def redeliver(self, delivery_id: str, endpoint_id: str) -> Delivery:
        """Send again (same message id, a fresh retry schedule)."""
        with self.engine.begin() as conn:
            conn.execute(update(webhook_deliveries).where(webhook_deliveries.c.id == delivery_id, webhook_deliveries.c.endpoint_id == endpoint_id)
                         .values(status="pending", attempts=0, next_attempt_at=utcnow(), lease_until=None, updated_at=utcnow()))
        return self.get_delivery(delivery_id, endpoint_id)

    # --- the fan-out cursor over operation events ---------------------------------------------

    def cursor(self, name: str) -> int:
        with self.engine.begin() as conn:
            conn.execute(insert_ignore(self.engine, dispatch_cursor).values(name=name, seq=0))
            return conn.execute(select(dispatch_cursor.c.seq).where(dispatch_cursor.c.name == name)).scalar_one()

    def advance(self, name: str, old: int, new: int) -> bool:
        with self.engine.begin() as conn:
            return conn.execute(update(dispatch_cursor).where(and_(dispatch_cursor.c.name == name, dispatch_cursor.c.seq == old)).values(seq=new)).rowcount == 1
