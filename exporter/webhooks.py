"""Outbound webhooks, signed per the Standard Webhooks specification.

- Events: ``export.started``, ``export.succeeded``, ``export.failed``,
  ``export.cancelled`` (from the operations' event log) and
  ``checkpoint.expiring`` (from the sweeper).
- Fan-out reads the operation event log past a shared cursor and inserts one
  delivery per (endpoint, event); the uniqueness of (endpoint, source) makes
  a repeated fan-out — two dispatchers, a restart — harmless.
- Each delivery carries ``webhook-id`` (the same on every retry),
  ``webhook-timestamp`` and ``webhook-signature`` (``v1,`` + base64
  HMAC-SHA256 of ``id.timestamp.body`` under the endpoint's ``whsec_``
  secret). Only a 2xx counts; redirects are not followed; each attempt has a
  bounded timeout; a 410 disables the endpoint; other failures retry on the
  configured schedule with jitter, then give up. Every attempt is logged.
- SSRF guard: the target host is resolved and every address must be public,
  unless it lies in a network the configuration allows (tests allow
  loopback). Checked when an endpoint is registered and again before each send.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
import logging
import random
import secrets
import socket
import threading
import time
from datetime import datetime, timedelta, timezone
from urllib.parse import urlsplit

from converters import errors as E
from converters.errors import ExportError

from .crypto import SecretBox
from .store import Store
from .store.util import utcnow
from .store.webhooks import Delivery, Webhooks

log = logging.getLogger("nucleus_export.webhooks")

EVENTS = ("export.started", "export.succeeded", "export.failed", "export.cancelled", "checkpoint.expiring")
# operation event log -> webhook event type
_STATUS_EVENTS = {"succeeded": "export.succeeded", "failed": "export.failed", "cancelled": "export.cancelled"}
CURSOR = "webhooks"
SETTLE_SECONDS = 10


def new_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def sign(secret: str, msg_id: str, timestamp: int, body: str) -> str:
    key = base64.b64decode(secret.removeprefix("whsec_"))
    mac = hmac.new(key, f"{msg_id}.{timestamp}.{body}".encode(), hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def parse_networks(spec: str | None) -> tuple:
    return tuple(ipaddress.ip_network(n.strip(), strict=False) for n in (spec or "").split(",") if n.strip())


def check_url(url: str, allowed_networks: tuple = ()) -> None:
    """Refuse anything but http(s) to public addresses (or explicitly allowed networks)."""
    u = urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ExportError(E.WEBHOOK_URL_REFUSED, f"webhook URL {url!r} must be an absolute http:// or https:// URL.", field="url")
    try:
        infos = socket.getaddrinfo(u.hostname, u.port or (443 if u.scheme == "https" else 80), type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise ExportError(E.WEBHOOK_URL_REFUSED, f"the webhook host {u.hostname!r} does not resolve; check the URL.", field="url") from None
    for info in infos:
        ip = ipaddress.ip_address(info[4][0].split("%")[0])
        if not ip.is_global and not any(ip in n for n in allowed_networks):
            raise ExportError(E.WEBHOOK_URL_REFUSED, f"the webhook host {u.hostname!r} resolves to {ip}, which is not a public address; use a public endpoint.", field="url")


class Dispatcher:
    def __init__(self, store: Store, webhooks: Webhooks, box: SecretBox, *, schedule: tuple[float, ...] = (5, 300, 1800, 7200, 18000, 36000),
                 timeout: float = 10.0, allowed_networks: tuple = (), poll_seconds: float = 1.0):
        self.store, self.webhooks, self.box = store, webhooks, box
        self.schedule, self.timeout, self.allowed, self.poll = schedule, timeout, allowed_networks, poll_seconds

    # --- fan-out ----------------------------------------------------------------------------

    def fan_out(self, limit: int = 500) -> int:
        from sqlalchemy import select

        from .store.schema import operation_events, operations

        start = self.webhooks.cursor(CURSOR)
        settled = utcnow() - timedelta(seconds=SETTLE_SECONDS)
        with self.store.engine.connect() as conn:
            rows = conn.execute(select(operation_events, operations.c.tenant).join(operations, operations.c.id == operation_events.c.operation_id)
                                .where(operation_events.c.seq > start, operation_events.c.kind.in_(("claimed", "status")))
                                .order_by(operation_events.c.seq).limit(limit)).all()
            # the cursor only passes events old enough that no transaction holding a lower seq can still commit
            safe = conn.execute(select(operation_events.c.seq).where(operation_events.c.seq > start, operation_events.c.at <= settled)
                                .order_by(operation_events.c.seq.desc()).limit(1)).scalar()
        n = 0
        for r in rows:
            data = r.data or {}
            event = "export.started" if r.kind == "claimed" and data.get("attempt") == 1 else _STATUS_EVENTS.get(data.get("to")) if r.kind == "status" else None
            if event is None or r.tenant is None:
                continue
            for ep in self.webhooks.endpoints_for(r.tenant, event):
                n += self.webhooks.enqueue(ep.id, f"op-event:{r.seq}", event, self._payload(event, self.store.get(r.operation_id).to_dict(), r.at))
        if len(rows) == limit:
            safe = min(safe or start, rows[-1].seq)
        if safe and safe > start:
            self.webhooks.advance(CURSOR, start, safe)  # a concurrent dispatcher may have moved it: then its value stands
        return n

    @staticmethod
    def _payload(event: str, data: dict, at: datetime) -> dict:
        at = at if at.tzinfo else at.replace(tzinfo=timezone.utc)
        data = {k: v for k, v in data.items() if k != "request"}
        return {"type": event, "timestamp": at.isoformat(), "data": data}

    def notify(self, tenant: str, event: str, source: str, data: dict) -> int:
        return sum(self.webhooks.enqueue(ep.id, source, event, self._payload(event, data, utcnow())) for ep in self.webhooks.endpoints_for(tenant, event))

    # --- sending ----------------------------------------------------------------------------

    def deliver_due(self) -> int:
        due = self.webhooks.claim_due(lease_seconds=self.timeout * 3 + 30)
        for d in due:
            self.send(d)
        return len(due)

    def send(self, d: Delivery) -> None:
        import requests

        ep = self.webhooks.get_endpoint(None, d.endpoint_id)
        if not ep.enabled:
            self.webhooks.record_attempt(d, status_code=None, error="endpoint disabled", duration_ms=0, outcome="failed")
            return
        body = json.dumps(d.payload, separators=(",", ":"), sort_keys=True)
        ts = int(time.time())
        headers = {"webhook-id": d.id, "webhook-timestamp": str(ts), "webhook-signature": sign(self.box.open(ep.secret_enc), d.id, ts, body),
                   "content-type": "application/json", "user-agent": "nucleus-export-webhooks/1"}
        t0 = time.monotonic()
        status, error = None, None
        try:
            check_url(ep.url, self.allowed)  # again at send time: DNS may have changed since registration
            r = requests.post(ep.url, data=body.encode(), headers=headers, timeout=self.timeout, allow_redirects=False)
            status = r.status_code
            if not 200 <= status < 300:
                error = f"HTTP {status}" + (" (redirects are not followed)" if 300 <= status < 400 else "")
        except ExportError as exc:
            error = exc.message
        except requests.RequestException as exc:
            error = f"{exc.__class__.__name__}: {exc}"[:300]
        ms = int((time.monotonic() - t0) * 1000)
        if status is not None and 200 <= status < 300:
            self.webhooks.record_attempt(d, status_code=status, error=None, duration_ms=ms, outcome="succeeded")
        elif status == 410:
            self.webhooks.record_attempt(d, status_code=status, error="410 Gone: endpoint disabled", duration_ms=ms, outcome="failed")
            self.webhooks.disable(ep.id, "the receiver answered 410 Gone")
        elif d.attempts < len(self.schedule):
            delay = self.schedule[d.attempts] * random.uniform(0.8, 1.2)  # jitter: a receiver coming back is not stampeded
            self.webhooks.record_attempt(d, status_code=status, error=error, duration_ms=ms, outcome="pending", next_attempt_at=utcnow() + timedelta(seconds=delay))
        else:
            self.webhooks.record_attempt(d, status_code=status, error=error, duration_ms=ms, outcome="failed")
        log.info("webhook %s %s -> %s", d.id, d.event_type, status or error)

    # --- loop -------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                busy = self.fan_out() + self.deliver_due()
            except Exception:  # noqa: BLE001 - the loop outlives one bad round
                log.exception("webhook dispatch round failed")
                busy = 0
            if not busy:
                stop.wait(self.poll)
