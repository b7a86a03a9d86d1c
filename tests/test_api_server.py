"""The API behind a real uvicorn server on loopback: an export end to end, 100 concurrent Idempotency-Key requests, schemathesis."""

from __future__ import annotations

import hashlib
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from urllib.parse import quote

from exporter.api import create_app
from exporter.service import Services

from .service_helpers import CKPT, RUN, UvicornThread, pg_schema, settings_for, wait_for


def _service(tmp_path, sample, **over) -> Services:
    s = Services(settings_for(tmp_path, model_store=str(sample["model_store"]), **over))
    dest = s.artifacts.root / "checkpoints" / "acme" / RUN / "000240.tar.gz"
    dest.parent.mkdir(parents=True)
    shutil.copy(sample["archive"], dest)
    s.sample = {**sample, "uri": dest.as_uri()}
    return s


def _register(url, key, s) -> None:
    r = requests.post(f"{url}/v1/training-runs/{RUN}/checkpoints", headers={"Authorization": f"Bearer {key}"},
                      json={"checkpoint": CKPT, "uri": s.sample["uri"], "base_model": s.sample["base_id"], "sha256": s.sample["sha"]}, timeout=30)
    assert r.status_code == 201, r.text


def test_export_through_a_real_server(tmp_path, sample):
    s = _service(tmp_path, sample)
    server = UvicornThread(create_app(s, background={"workers": 1, "sweeper": False}))
    s.artifacts.base_url = server.url  # signed URLs point at this server
    try:
        _, key = s.keys.create("acme", ["train", "read"])
        h = {"Authorization": f"Bearer {key}"}
        _register(server.url, key, s)
        r = requests.post(f"{server.url}/v1/training-runs/{RUN}/checkpoints/{quote(CKPT, safe='')}/export",
                          json={"format": "gguf", "quant": "q8_0", "verify": False}, headers=h, timeout=30)
        assert r.status_code == 202, r.text
        op_url = server.url + r.headers["Location"]
        op = wait_for(lambda: (lambda o: o if o["status"] in ("succeeded", "failed") else None)(requests.get(op_url, headers=h, timeout=30).json()), timeout=300)
        assert op["status"] == "succeeded", op["error"]
        [gguf] = [f for f in op["result"]["files"] if f["name"].endswith(".gguf")]
        got = requests.get(gguf["url"], timeout=60)
        assert got.status_code == 200 and hashlib.sha256(got.content).hexdigest() == gguf["sha256"]
        assert got.headers["Content-Disposition"].startswith("attachment")
        tail = requests.get(gguf["url"], headers={"Range": "bytes=-100", "If-Range": got.headers["ETag"]}, timeout=60)
        assert tail.status_code == 206 and tail.content == got.content[-100:]
        assert requests.get(gguf["url"].replace("sig=", "sig=x"), timeout=30).status_code == 403
    finally:
        server.close()
        s.close()


@pytest.mark.parametrize("db", ["sqlite", "postgresql"])
def test_100_concurrent_identical_requests_create_one_operation(tmp_path, sample, db):
    def run(database_url):
        s = _service(tmp_path, sample, database_url=database_url)
        server = UvicornThread(create_app(s))
        try:
            _, key = s.keys.create("acme", ["train", "read"])
            _register(server.url, key, s)
            url = f"{server.url}/v1/training-runs/{RUN}/checkpoints/000240/export"
            h = {"Authorization": f"Bearer {key}", "Idempotency-Key": "burst-1"}

            def post(_):
                return requests.post(url, json={"format": "lora-adapter", "verify": False}, headers=h, timeout=60)

            with ThreadPoolExecutor(max_workers=50) as pool:
                responses = list(pool.map(post, range(100)))
            statuses = [r.status_code for r in responses]
            assert set(statuses) <= {202, 409}, statuses
            ops = {r.json()["operation"] for r in responses if r.status_code == 202}
            assert len(ops) == 1, "one operation, every 202 names it"
            assert all(r.json()["code"] == "idempotency_in_progress" for r in responses if r.status_code == 409)
            listed = requests.get(f"{server.url}/v1/operations", headers={"Authorization": f"Bearer {key}"}, timeout=30).json()["data"]
            assert [o["operation"] for o in listed] == list(ops)
            again = post(0)
            assert again.status_code == 202 and again.json()["operation"] in ops and again.headers["Idempotent-Replayed"] == "true"
        finally:
            server.close()
            s.close()

    if db == "sqlite":
        run(None)
    else:
        with pg_schema() as url:
            run(url)


def test_schemathesis_finds_no_server_errors(tmp_path, sample):
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error

    s = _service(tmp_path, sample)
    server = UvicornThread(create_app(s))
    try:
        _, key = s.keys.create("acme", ["train", "read", "infer"])
        _register(server.url, key, s)
        schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
        failures, calls = [], []
        for result in schema.get_all_operations():
            operation = result.ok()

            @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            @given(case=operation.as_strategy())
            def check(case):
                response = case.call(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
                calls.append((case.method, response.status_code))
                if response.status_code >= 500:
                    failures.append(f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:300]}")
                case.validate_response(response, checks=[not_a_server_error])

            try:
                check()
            except Exception as exc:  # noqa: BLE001 - collected, reported together
                failures.append(f"{operation.method.upper()} {operation.path}: {str(exc)[:500]}")
        assert not failures, "\n".join(failures)
        assert len(calls) > 200 and len({m for m, _ in calls}) >= 4, "schemathesis exercised every route"
        assert any(200 <= c < 300 for _, c in calls) and any(400 <= c < 500 for _, c in calls)
    finally:
        server.close()
        s.close()
