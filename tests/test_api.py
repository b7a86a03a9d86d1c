"""The HTTP API through the ASGI app: exports, operations, checkpoints, keys and scopes, tenants, Idempotency-Key."""

from __future__ import annotations

import hashlib
import shutil
from urllib.parse import quote, urlsplit

import pytest

from exporter.api import create_app
from exporter.store.idempotency import IdempotencyKeys

from .service_helpers import CKPT, RUN, auth, client_for, export, keys, register, wait_for

def test_export_end_to_end(svc):
    k = keys(svc)
    with client_for(svc, background={"workers": 1, "sweeper": False}) as client:
        assert register(client, k["train"]).status_code == 201
        r = export(client, k["train"])
        assert r.status_code == 202, r.text
        body = r.json()
        assert set(body) == {"operation", "format", "status"} and body["operation"].startswith("op_") and body["format"] == "lora-adapter"
        assert r.headers["Location"] == f"/v1/operations/{body['operation']}"
        first = client.get(r.headers["Location"], headers=auth(k["read"]))
        assert first.status_code == 200
        if first.json()["status"] not in ("succeeded", "failed"):
            assert first.headers["Retry-After"] == "2"

        def finished():
            op = client.get(f"/v1/operations/{body['operation']}", headers=auth(k["read"])).json()
            return op if op["status"] in ("succeeded", "failed", "cancelled") else None

        op = wait_for(finished)
        assert op["status"] == "succeeded", op["error"]
        assert op["progress"]["percent"] == 100.0 and op["checkpoint_id"] == "sampler_weights/000240" and "request" not in op
        final = client.get(f"/v1/operations/{body['operation']}", headers=auth(k["read"]))
        assert "Retry-After" not in final.headers
        for f in op["result"]["files"]:
            u = urlsplit(f["url"])
            got = client.get(f"{u.path}?{u.query}")
            assert got.status_code == 200 and hashlib.sha256(got.content).hexdigest() == f["sha256"] and f["expires_at"]
            part = client.get(f"{u.path}?{u.query}", headers={"Range": "bytes=0-9"})
            assert part.status_code == 206 and part.content == got.content[:10]
        events = client.get(f"/v1/operations/{body['operation']}/events", headers=auth(k["read"])).json()["data"]
        assert [e["data"]["stage"] for e in events if e["kind"] == "stage"] == ["fetching", "verifying", "converting", "publishing"]
        fresh = client.post(f"/v1/operations/{body['operation']}/download-urls", headers=auth(k["read"])).json()
        assert [f["sha256"] for f in fresh["result"]["files"]] == [f["sha256"] for f in op["result"]["files"]]


def test_operations_list_filters_and_pages(svc):
    k = keys(svc)
    with client_for(svc) as client:
        register(client, k["train"])
        ids = [export(client, k["train"], {"format": fmt, "verify": False}).json()["operation"] for fmt in ("lora-adapter", "gguf", "merged-safetensors")]
        page = client.get("/v1/operations?limit=2", headers=auth(k["read"])).json()
        assert [o["operation"] for o in page["data"]] == ids[::-1][:2] and page["next_cursor"]
        rest = client.get(f"/v1/operations?limit=2&cursor={page['next_cursor']}", headers=auth(k["read"])).json()
        assert [o["operation"] for o in rest["data"]] == [ids[0]] and rest["next_cursor"] is None
        only = client.get("/v1/operations?format=gguf&status=queued&run=run_3Bz", headers=auth(k["read"])).json()["data"]
        assert [o["operation"] for o in only] == [ids[1]]
        assert client.get("/v1/operations?status=bogus", headers=auth(k["read"])).json()["code"] == "validation_failed"
        assert client.get("/v1/operations?cursor=%%%", headers=auth(k["read"])).status_code == 422
        r = client.post(f"/v1/operations/{ids[0]}/cancel", headers=auth(k["train"]))
        assert r.status_code == 202 and r.json()["status"] == "cancelled"


def test_keys_and_scopes(svc):
    k = keys(svc)
    with client_for(svc) as client:
        r = client.get("/v1/operations")
        assert r.status_code == 401 and r.json()["code"] == "unauthorized" and r.headers["WWW-Authenticate"] == "Bearer"
        assert client.get("/v1/operations", headers=auth("nxk_0000000000000000_" + "x" * 43)).status_code == 401
        assert client.get("/v1/operations", headers=auth("garbage")).status_code == 401
        r = register(client, k["read"])
        assert r.status_code == 403 and r.json()["code"] == "forbidden"
        assert client.get("/v1/operations", headers=auth(k["infer"])).status_code == 403
        assert register(client, k["train"]).status_code == 201
        r = export(client, k["read"])
        assert r.status_code == 403
        key_id = k["train"].split("_")[1]
        assert svc.keys.revoke(key_id)
        assert client.get("/v1/operations", headers=auth(k["train"])).status_code == 401
        stored = (svc.settings.data_dir / "operations.db").read_bytes()
        assert k["read"].split("_", 2)[2].encode() not in stored, "only a hash of a key is stored"


def test_tenants_see_only_their_own(svc):
    a, b = keys(svc, "acme"), keys(svc, "globex")
    with client_for(svc) as client:
        register(client, a["train"])
        op = export(client, a["train"]).json()["operation"]
        assert client.get(f"/v1/operations/{op}", headers=auth(b["read"])).status_code == 404
        assert client.get("/v1/operations", headers=auth(b["read"])).json()["data"] == []
        assert client.post(f"/v1/operations/{op}/cancel", headers=auth(b["train"])).status_code == 404
        assert client.get(f"/v1/training-runs/{RUN}/checkpoints/000240", headers=auth(b["read"])).json()["code"] == "checkpoint_not_found"
        assert export(client, b["train"]).status_code == 404


@pytest.mark.parametrize("body, status, code, field", [
    ({"format": "onnx"}, 422, "validation_failed", "format"),
    ({"format": "gguf", "quant": "q9_z"}, 422, "invalid_option", "quant"),
    ({"format": "merged-safetensors", "quant": "q4_k_m"}, 422, "validation_failed", "quant"),
    ({"format": "merged-safetensors", "dtype": "int3"}, 422, "invalid_option", "dtype"),
    ({"format": "lora-adapter", "destination": "hf-hub"}, 422, "hub_repo_invalid", "hf_repo"),
    ({"format": "lora-adapter", "destination": "hf-hub", "hf_repo": "a/b", "hf_token_ref": "env:HOME"}, 422, "secret_not_found", "hf_token_ref"),
    ({"format": "lora-adapter", "hf_repo": "a/b"}, 422, "validation_failed", "hf_repo"),
    ({"format": "lora-adapter", "surprise": 1}, 422, "validation_failed", "surprise"),
    ({"format": "lora-adapter", "destination": "ftp"}, 422, "validation_failed", "destination"),
])
def test_invalid_exports_are_refused_at_once(svc, body, status, code, field):
    k = keys(svc)
    with client_for(svc) as client:
        register(client, k["train"])
        r = export(client, k["train"], body)
        assert (r.status_code, r.json()["code"], r.json().get("field")) == (status, code, field), r.text
        assert r.json()["message"]
        assert client.get("/v1/operations", headers=auth(k["read"])).json()["data"] == [], "no operation was created"


def test_checkpoints_register_get_expire_and_download(svc, tmp_path):
    k = keys(svc)
    with client_for(svc) as client:
        r = register(client, k["train"], ttl_seconds=3600)
        assert r.status_code == 201 and r.json()["checkpoint_id"] == "sampler_weights/000240" and r.json()["expires_at"]
        assert register(client, k["train"], ttl_seconds=3600).status_code == 200, "registering the same archive again is a no-op"
        r = register(client, k["train"], uri="https://example.com/another.tar")
        assert r.status_code == 409 and r.json()["code"] == "checkpoint_exists"
        assert client.post(f"/v1/training-runs/{RUN}/checkpoints", json={"checkpoint": "nucleus://run_other/x", "uri": "file:///x"}, headers=auth(k["train"])).status_code == 422
        for name in ("000240", "sampler_weights/000240", quote(CKPT, safe="")):
            g = client.get(f"/v1/training-runs/{RUN}/checkpoints/{name}", headers=auth(k["read"]))
            assert g.status_code == 200 and g.json()["checkpoint"] == "nucleus://run_3Bz/sampler_weights/000240", name
        assert len(client.get(f"/v1/training-runs/{RUN}/checkpoints", headers=auth(k["read"])).json()["data"]) == 1
        r = client.patch(f"/v1/training-runs/{RUN}/checkpoints/000240/expiry", json={"ttl_seconds": None}, headers=auth(k["train"]))
        assert r.status_code == 200 and r.json()["expires_at"] is None
        r = client.patch(f"/v1/training-runs/{RUN}/checkpoints/000240/expiry", json={"ttl_seconds": 60}, headers=auth(k["train"]))
        assert r.json()["expires_at"]
        assert client.patch(f"/v1/training-runs/{RUN}/checkpoints/000240/expiry", json={}, headers=auth(k["train"])).status_code == 422
        u = client.get(f"/v1/training-runs/{RUN}/checkpoints/000240/download-url", headers=auth(k["read"])).json()
        parts = urlsplit(u["url"])
        got = client.get(f"{parts.path}?{parts.query}")
        assert hashlib.sha256(got.content).hexdigest() == svc.sample["sha"]
        assert register(client, k["train"], checkpoint=None, checkpoint_id="000300", uri="https://example.com/ckpt.tar.zst").status_code == 201
        r = client.get(f"/v1/training-runs/{RUN}/checkpoints/000300/download-url", headers=auth(k["read"]))
        assert r.status_code == 409 and r.json()["code"] == "archive_not_downloadable"


def test_archives_register_only_from_the_tenants_own_places(svc, tmp_path):
    """A key cannot point the workers at another tenant's archive, an export, or any file or bucket they can reach."""
    from dataclasses import replace

    k = keys(svc)
    root = svc.artifacts.root
    outside = tmp_path / "outside.tar.gz"
    shutil.copy(svc.sample["archive"], outside)
    refused = [(root / "checkpoints" / "globex" / RUN / "x.tar.gz").as_uri(), (root / "exports" / "op_1" / "model.safetensors").as_uri(),
               (root / "checkpoints" / "acme" / ".." / "globex" / "x.tar").as_uri(), "file:///etc/passwd", outside.as_uri(),
               "s3://someone-elses-bucket/ckpt.tar", "ftp://host/ckpt.tar"]
    with client_for(svc) as client:
        for i, uri in enumerate(refused):
            r = register(client, k["train"], checkpoint=None, checkpoint_id=f"bad{i}", uri=uri)
            assert r.status_code == 422 and r.json()["code"] in ("archive_uri_refused", "fetch_unsupported") and r.json()["field"] == "uri", (uri, r.text)
    svc.settings = replace(svc.settings, archive_roots=str(tmp_path), archive_buckets="shared-archives")
    with client_for(svc) as client:
        assert register(client, k["train"], checkpoint=None, checkpoint_id="root", uri=outside.as_uri()).status_code == 201
        for base in ("/etc", "../models/x", "no-namespace"):
            r = register(client, k["train"], checkpoint=None, checkpoint_id="b", base_model=base)
            assert r.status_code == 422 and r.json()["field"] == "base_model", "the service names base models by Hub id only"
        assert register(client, k["train"], checkpoint=None, checkpoint_id="bucket", uri="s3://shared-archives/run/ckpt.tar").status_code == 201


def test_sweeper_deletes_expired_archives_but_not_one_an_export_needs(svc):
    from datetime import timedelta

    from exporter.store.util import utcnow
    from exporter.sweeper import Sweeper

    k = keys(svc)
    with client_for(svc) as client:
        register(client, k["train"], ttl_seconds=60)
        second = svc.artifacts.root / "checkpoints" / "acme" / RUN / "000300.tar.gz"
        shutil.copy(svc.sample["archive"], second)
        register(client, k["train"], checkpoint=None, checkpoint_id="000300", uri=second.as_uri(), ttl_seconds=60)
        op = export(client, k["train"]).json()["operation"]  # queued: it needs 000240's archive
        report = Sweeper(svc).sweep(now=utcnow() + timedelta(seconds=120))
        assert report["deleted"] == [f"nucleus://{RUN}/000300"] and report["kept"] == [f"nucleus://{RUN}/sampler_weights/000240"]
        assert not second.exists() and (svc.artifacts.root / "checkpoints" / "acme" / RUN / "000240.tar.gz").exists()
        r = export(client, k["train"], ckpt="000300")
        assert r.status_code == 410 and r.json()["code"] == "checkpoint_deleted"
        assert client.get(f"/v1/training-runs/{RUN}/checkpoints/000300", headers=auth(k["read"])).json()["deleted"] is True
        client.post(f"/v1/operations/{op}/cancel", headers=auth(k["train"]))
        report = Sweeper(svc).sweep(now=utcnow() + timedelta(seconds=120))
        assert report["deleted"] == [f"nucleus://{RUN}/sampler_weights/000240"], "no export needs it any more"


def test_idempotency_key(svc):
    k, other = keys(svc), keys(svc, "globex")
    with client_for(svc) as client:
        register(client, k["train"])
        theirs = svc.artifacts.root / "checkpoints" / "globex" / RUN / "000240.tar.gz"
        theirs.parent.mkdir(parents=True)
        shutil.copy(svc.sample["archive"], theirs)
        assert register(client, other["train"], uri=theirs.as_uri()).status_code == 201
        a = export(client, k["train"], headers={"Idempotency-Key": "k-1"})
        b = export(client, k["train"], headers={"Idempotency-Key": "k-1"})
        assert a.status_code == b.status_code == 202 and a.json() == b.json() and b.headers["Idempotent-Replayed"] == "true"
        assert b.headers["Location"] == a.headers["Location"]
        c = export(client, k["train"], {"format": "gguf"}, headers={"Idempotency-Key": "k-1"})
        assert c.status_code == 422 and c.json()["code"] == "idempotency_conflict"
        d = export(client, other["train"], headers={"Idempotency-Key": "k-1"})
        assert d.status_code == 202 and d.json()["operation"] != a.json()["operation"], "keys are scoped per tenant"
        # a request still being processed under a key: 409
        from exporter.store import fingerprint

        fp = fingerprint({"run_id": RUN, "checkpoint_id": "sampler_weights/000240", "body": {"format": "lora-adapter", "destination": "signed-url", "hf_repo": None,
                          "quant": None, "dtype": None, "verify": False, "private": None, "revision": None, "commit_message": None, "replace_card": False, "hf_token_ref": None, "allow_unknown_pretokenizer": None}})
        assert svc.idempotency.begin("acme", "k-2", fp) is None
        e = export(client, k["train"], headers={"Idempotency-Key": "k-2"})
        assert e.status_code == 409 and e.json()["code"] == "idempotency_in_progress"
        # a failed request gives its key back
        f = export(client, k["train"], {"format": "onnx"}, headers={"Idempotency-Key": "k-3"})
        g = export(client, k["train"], headers={"Idempotency-Key": "k-3"})
        assert f.status_code == 422 and g.status_code == 202
        assert len(client.get("/v1/operations", headers=auth(k["read"])).json()["data"]) == 2


def test_idempotency_retention(svc):
    short = IdempotencyKeys(svc.store.engine, retention_seconds=0.2)
    assert short.begin("t", "key", "fp1") is None
    short.finish("t", "key", 202, {"operation": "op_1"}, {})
    assert short.begin("t", "key", "fp1").body == {"operation": "op_1"}
    import time

    time.sleep(0.3)
    assert short.begin("t", "key", "fp2") is None, "past its retention the key is free again"
    assert short.purge() == 0


def test_openapi_spec_is_committed_and_current(svc):
    import json
    from pathlib import Path

    committed = json.loads((Path(__file__).parents[1] / "docs" / "openapi.json").read_text())
    assert committed == json.loads(json.dumps(create_app(svc).openapi())), "run `python scripts/gen_openapi.py` and commit docs/openapi.json"
    paths = committed["paths"]
    assert "/v1/training-runs/{run_id}/checkpoints/{checkpoint_id}/export" in paths and "/v1/operations/{operation_id}" in paths
