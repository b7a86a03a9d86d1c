"""Outbound webhooks (Standard Webhooks, verified with the `standardwebhooks` package) and the inbound checkpoint hook."""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone

import pytest
from standardwebhooks.webhooks import Webhook

from exporter.store.util import utcnow
from exporter.sweeper import Sweeper
from exporter.webhooks import Dispatcher

from .service_helpers import INBOUND_SECRET, RUN, Receiver, auth, client_for, export, keys, register, wait_for


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def drain(svc, rounds: int = 40) -> None:
    """Run the dispatcher until nothing is due (retries are 50 ms apart in these settings)."""
    for _ in range(rounds):
        svc.dispatcher.fan_out()
        svc.dispatcher.deliver_due()
        time.sleep(0.06)


def subscribe(client, key, url, events=("export.started", "export.succeeded", "export.failed", "export.cancelled")):
    r = client.post("/v1/webhooks", json={"url": url, "events": list(events)}, headers=auth(key))
    assert r.status_code == 201, r.text
    return r.json()


def test_deliveries_are_signed_retried_and_logged(svc, receiver):
    receiver.fail_each = (500, 503, 502)  # the receiver fails each message three times first
    k = keys(svc)
    with client_for(svc, background={"workers": 1, "sweeper": False, "dispatcher": False}) as client:
        ep = subscribe(client, k["train"], receiver.url)
        assert ep["secret"].startswith("whsec_")
        assert "secret" not in client.get(f"/v1/webhooks/{ep['id']}", headers=auth(k["read"])).json(), "the secret is shown once"
        register(client, k["train"])
        op = export(client, k["train"]).json()["operation"]
        wait_for(lambda: client.get(f"/v1/operations/{op}", headers=auth(k["read"])).json()["status"] == "succeeded")
        wait_for(lambda: (drain(svc, 5), sorted(receiver.events()) == ["export.started", "export.succeeded"])[1], timeout=30)
    wh = Webhook(ep["secret"])
    for r in receiver.received:
        payload = wh.verify(r["body"], r["headers"])  # raises unless signature and timestamp are right
        assert payload["data"]["operation"] == op
    ids = [r["headers"]["webhook-id"] for r in receiver.received]
    first = receiver.received[0]["headers"]["webhook-id"]
    assert len(set(ids)) == 2 and all(ids.count(i) == 4 for i in set(ids)), "the same message id on every retry: three failures, then success"
    log = client.get(f"/v1/webhooks/{ep['id']}/deliveries", headers=auth(k["read"])).json()["data"]
    assert len(log) == 2
    for d in log:
        assert d["status"] == "succeeded" and [a["status_code"] for a in d["log"]] == [500, 503, 502, 200]
    # redeliver: the same message again
    r = client.post(f"/v1/webhooks/{ep['id']}/deliveries/{first}/redeliver", headers=auth(k["train"]))
    assert r.status_code == 202 and r.json()["status"] == "pending"
    drain(svc, 3)
    assert [r["headers"]["webhook-id"] for r in receiver.received].count(first) == 5


def test_fan_out_twice_delivers_once(svc, receiver):
    """Two dispatchers (or a restart) reading the same events never duplicate a delivery."""
    k = keys(svc)
    with client_for(svc) as client:
        subscribe(client, k["train"], receiver.url, ["export.cancelled"])
        register(client, k["train"])
        op = export(client, k["train"]).json()["operation"]
        client.post(f"/v1/operations/{op}/cancel", headers=auth(k["train"]))
    other = Dispatcher(svc.store, svc.webhooks, svc.box, schedule=(0.05,), allowed_networks=svc.allowed_networks)
    assert svc.dispatcher.fan_out() == 1
    svc.webhooks.advance("webhooks", svc.webhooks.cursor("webhooks"), 0)  # as if the cursor had not been saved
    assert other.fan_out() == 0
    drain(svc, 3)
    assert receiver.events() == ["export.cancelled"]


def test_a_410_disables_the_endpoint(svc, receiver):
    receiver.statuses = [410]
    k = keys(svc)
    with client_for(svc) as client:
        ep = subscribe(client, k["train"], receiver.url, ["export.cancelled"])
        register(client, k["train"])
        for _ in range(2):
            op = export(client, k["train"]).json()["operation"]
            client.post(f"/v1/operations/{op}/cancel", headers=auth(k["train"]))
        drain(svc, 3)
        got = client.get(f"/v1/webhooks/{ep['id']}", headers=auth(k["read"])).json()
        assert got["enabled"] is False and "410" in got["disabled_reason"]
        assert len(receiver.received) == 1, "nothing more is sent to a disabled endpoint"
        statuses = sorted(d["status"] for d in client.get(f"/v1/webhooks/{ep['id']}/deliveries", headers=auth(k["read"])).json()["data"])
        assert statuses == ["failed", "failed"]


def test_redirects_are_not_followed_and_failures_give_up(svc, receiver):
    receiver.statuses = [302] * 10
    receiver.extra_headers = {"Location": "http://127.0.0.1:1/elsewhere"}
    k = keys(svc)
    with client_for(svc) as client:
        ep = subscribe(client, k["train"], receiver.url, ["export.cancelled"])
        register(client, k["train"])
        op = export(client, k["train"]).json()["operation"]
        client.post(f"/v1/operations/{op}/cancel", headers=auth(k["train"]))
        drain(svc, 12)
        [d] = client.get(f"/v1/webhooks/{ep['id']}/deliveries", headers=auth(k["read"])).json()["data"]
    assert d["status"] == "failed" and d["attempts"] == 5, "one try and the four scheduled retries"
    assert "redirects are not followed" in d["last_error"]
    assert len(receiver.received) == 5


@pytest.mark.parametrize("url", ["http://10.1.2.3/hook", "http://169.254.169.254/latest/meta-data", "ftp://127.0.0.1/x", "http://[fd00::1]/x", "not a url",
                                 "http://nonexistent.invalid/hook"])
def test_ssrf_guard_refuses_non_public_targets(svc, url):
    k = keys(svc)
    with client_for(svc) as client:
        r = client.post("/v1/webhooks", json={"url": url, "events": ["export.succeeded"]}, headers=auth(k["train"]))
    assert r.status_code == 422 and r.json()["code"] == "webhook_url_refused", r.text


def test_ssrf_guard_refuses_loopback_unless_allowed():
    from converters.errors import ExportError
    from exporter.webhooks import check_url, parse_networks

    with pytest.raises(ExportError) as e:
        check_url("http://127.0.0.1:9/x")
    assert e.value.code == "webhook_url_refused"
    check_url("http://127.0.0.1:9/x", parse_networks("127.0.0.0/8"))


def test_checkpoint_expiring_is_announced_once(svc, receiver):
    k = keys(svc)
    with client_for(svc) as client:
        subscribe(client, k["train"], receiver.url, ["checkpoint.expiring"])
        register(client, k["train"], ttl_seconds=3600)
    sweeper = Sweeper(svc)
    assert sweeper.sweep()["notified"] == [f"nucleus://{RUN}/sampler_weights/000240"]
    assert sweeper.sweep()["notified"] == []
    drain(svc, 2)
    [r] = receiver.received
    payload = Webhook(svc.box.open(svc.webhooks.list_endpoints("acme")[0].secret_enc)).verify(r["body"], r["headers"])
    assert payload["type"] == "checkpoint.expiring" and payload["data"]["checkpoint_id"] == "sampler_weights/000240"


# --- inbound: the trainer's checkpoint-saved hook -----------------------------------------------


def signed(body: dict, secret: str = INBOUND_SECRET, msg_id: str = "msg_1", at: datetime | None = None) -> tuple[bytes, dict]:
    raw = json.dumps(body).encode()
    at = at or datetime.now(timezone.utc)
    sig = Webhook(secret).sign(msg_id, at, raw.decode())
    return raw, {"webhook-id": msg_id, "webhook-timestamp": str(int(at.timestamp())), "webhook-signature": sig, "content-type": "application/json"}


def test_inbound_hook_starts_rule_exports_exactly_once(svc):
    k = keys(svc)
    with client_for(svc) as client:
        r = client.post(f"/v1/training-runs/{RUN}/export-rules", json={"formats": ["lora-adapter", "gguf"], "quant": "q8_0", "every_n_steps": 40},
                        headers=auth(k["train"]))
        assert r.status_code == 201, r.text
        rule = r.json()
        hook = {"type": "checkpoint.saved", "data": {"checkpoint": "nucleus://run_3Bz:train:0/sampler_weights/000240", "uri": svc.sample["uri"],
                                                     "base_model": svc.sample["base_id"], "step": 240, "sha256": svc.sample["sha"]}}
        raw, headers = signed(hook)
        first = client.post("/v1/hooks/checkpoint-saved", content=raw, headers=headers)
        assert first.status_code == 200, first.text
        ops = first.json()["operations"]
        assert sorted(o["format"] for o in ops) == ["gguf", "lora-adapter"] and all(o["created"] and o["rule_id"] == rule["id"] for o in ops)
        again = client.post("/v1/hooks/checkpoint-saved", content=raw, headers=headers)  # delivered twice
        assert [o["operation"] for o in again.json()["operations"]] == [o["operation"] for o in ops] and not any(o["created"] for o in again.json()["operations"])
        listed = client.get("/v1/operations", headers=auth(k["read"])).json()["data"]
        assert len(listed) == 2
        gguf = svc.store.get(next(o["operation"] for o in ops if o["format"] == "gguf"))
        assert gguf.request["options"]["quant"] == "q8_0" and "quant" not in svc.store.get(next(o["operation"] for o in ops if o["format"] == "lora-adapter")).request["options"]
        assert client.get(f"/v1/training-runs/{RUN}/checkpoints/000240", headers=auth(k["read"])).json()["step"] == 240
        # a step the rule skips
        off = {"type": "checkpoint.saved", "data": {**hook["data"], "checkpoint": "nucleus://run_3Bz:train:0/sampler_weights/000250", "step": 250}}
        raw, headers = signed(off, msg_id="msg_2")
        assert client.post("/v1/hooks/checkpoint-saved", content=raw, headers=headers).json()["operations"] == []
        # bad signatures, stale timestamps, bad bodies
        raw, headers = signed(hook, secret="whsec_" + "A" * 32)
        r = client.post("/v1/hooks/checkpoint-saved", content=raw, headers=headers)
        assert r.status_code == 401 and r.json()["code"] == "hook_bad_signature"
        raw, headers = signed(hook, at=utcnow() - timedelta(hours=1))
        assert client.post("/v1/hooks/checkpoint-saved", content=raw, headers=headers).status_code == 401
        raw, headers = signed({"type": "checkpoint.saved", "data": {"checkpoint": "s3://nope"}})
        r = client.post("/v1/hooks/checkpoint-saved", content=raw, headers=headers)
        assert r.status_code == 422 and r.json()["code"] == "validation_failed"
        assert client.delete(f"/v1/training-runs/{RUN}/export-rules/{rule['id']}", headers=auth(k["train"])).status_code == 204
        assert client.get(f"/v1/training-runs/{RUN}/export-rules", headers=auth(k["read"])).json()["data"] == []


def test_export_rule_validation(svc):
    k = keys(svc)
    with client_for(svc) as client:
        r = client.post(f"/v1/training-runs/{RUN}/export-rules", json={"formats": ["gguf"], "destination": "hf-hub"}, headers=auth(k["train"]))
        assert r.status_code == 422 and r.json()["code"] == "hub_repo_invalid"
        r = client.post(f"/v1/training-runs/{RUN}/export-rules", json={"formats": ["gguf"], "every_n_steps": 0}, headers=auth(k["train"]))
        assert r.status_code == 422 and r.json()["field"] == "every_n_steps"
