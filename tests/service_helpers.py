"""Helpers for the service tests: a services container on a temp data dir, a real uvicorn server, a webhook receiver."""

from __future__ import annotations

import json
import secrets
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from exporter.api.server import BackgroundServer as UvicornThread  # noqa: F401 - the app under a real uvicorn on loopback
from exporter.settings import Settings

RUN = "run_3Bz"
CKPT = "nucleus://run_3Bz:train:0/sampler_weights/000240"
INBOUND_SECRET = "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def settings_for(tmp_path, **over) -> Settings:
    base = Settings(data_dir=tmp_path / "service", webhook_allowed_networks="127.0.0.0/8,::1/128", webhook_retry_schedule="0.05,0.05,0.05,0.05",
                    webhook_timeout_seconds=5, inbound_webhook_secret=INBOUND_SECRET, heartbeat_seconds=0.2, lease_seconds=30,
                    public_base_url="http://testserver")
    return replace(base, **over)


@contextmanager
def pg_schema():
    """A PostgreSQL URL whose search_path is a fresh schema, dropped afterwards."""
    from sqlalchemy import create_engine, text

    schema = "nx_test_" + secrets.token_hex(6)
    admin = create_engine(PG_URL)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield f"{PG_URL}?options=-csearch_path%3D{schema}"
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


class Receiver:
    """A webhook receiver on loopback: answers from a script of status codes (then 200), records every request."""

    def __init__(self, statuses: list[int] | None = None, headers: dict | None = None):
        self.statuses = list(statuses or [])
        self.fail_each: tuple[int, ...] = ()  # statuses each new message id gets before a 200
        self._seen: dict[str, int] = {}
        self.extra_headers = headers or {}
        self.received: list[dict] = []
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                mid = self.headers.get("webhook-id", "")
                n = outer._seen[mid] = outer._seen.get(mid, 0) + 1
                status = outer.fail_each[n - 1] if n <= len(outer.fail_each) else outer.statuses.pop(0) if outer.statuses else 200
                outer.received.append({"headers": {k.lower(): v for k, v in self.headers.items()}, "body": body, "status": status})
                self.send_response(status)
                for k, v in outer.extra_headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hook"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def events(self) -> list[str]:
        return [json.loads(r["body"])["type"] for r in self.received if 200 <= r["status"] < 300]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def wait_for(predicate, timeout: float = 120, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("timed out waiting")


def client_for(svc, background=None):
    from fastapi.testclient import TestClient

    from exporter.api import create_app

    return TestClient(create_app(svc, background=background), base_url="http://testserver")


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def keys(svc, tenant="acme"):
    return {scope: svc.keys.create(tenant, scopes)[1] for scope, scopes in {"train": ["train", "read"], "read": ["read"], "infer": ["infer"]}.items()}


def register(client, key, **over):
    body = {"checkpoint": CKPT, "uri": client.app.state.services.sample["uri"], "base_model": client.app.state.services.sample["base_id"], "step": 240,
            "sha256": client.app.state.services.sample["sha"], **over}
    return client.post(f"/v1/training-runs/{RUN}/checkpoints", json=body, headers=auth(key))


def export(client, key, body=None, ckpt="sampler_weights/000240", headers=None):
    body = body or {"format": "lora-adapter", "verify": False}
    return client.post(f"/v1/training-runs/{RUN}/checkpoints/{ckpt}/export", json=body, headers={**auth(key), **(headers or {})})
