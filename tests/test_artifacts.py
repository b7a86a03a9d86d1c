"""Artifact stores: HMAC signed URLs with ranged downloads (local) and presigned URLs (S3 via moto)."""

from __future__ import annotations

import hashlib
import os
import time
from urllib.parse import parse_qsl, urlsplit

import pytest

from converters import errors as E
from converters.errors import ExportError
from exporter.artifacts import S3_MAX_EXPIRY, LocalStore, S3Store

DATA = os.urandom(300_000)
KEY = "exports/op_123/model-Q4_K_M.gguf"


@pytest.fixture
def store(tmp_path):
    s = LocalStore(tmp_path / "artifacts", {"k1": b"secret-one"}, base_url="https://exports.example")
    src = tmp_path / "src.bin"
    src.write_bytes(DATA)
    s.put_file(src, KEY)
    return s


def split(url: str) -> tuple[str, dict[str, str]]:
    u = urlsplit(url)
    return u.path, dict(parse_qsl(u.query))


def get(store: LocalStore, url: str, headers: dict | None = None, method: str = "GET", now: float | None = None):
    path, query = split(url)
    r = store.serve(method, path, query, headers or {}, now=now)
    return r.status, r.headers, b"".join(r.body)


def test_round_trip(store):
    signed = store.signed_url(KEY, 3600)
    assert signed.url.startswith("https://exports.example/v1/artifacts/exports/op_123/")
    status, headers, body = get(store, signed.url)
    assert status == 200 and body == DATA
    assert headers["ETag"] == f'"{hashlib.sha256(DATA).hexdigest()}"'
    assert headers["Accept-Ranges"] == "bytes" and headers["Content-Length"] == str(len(DATA))
    assert headers["Content-Disposition"].startswith('attachment; filename="model-Q4_K_M.gguf"')
    assert abs(signed.expires_at.timestamp() - (time.time() + 3600)) < 5


@pytest.mark.parametrize("tamper", ["path", "expires", "sig", "kid", "method"])
def test_tampering_is_403(store, tamper):
    path, query = split(store.signed_url(KEY, 3600).url)
    method = "GET"
    if tamper == "path":
        path = path.replace("op_123", "op_124")
    elif tamper == "expires":
        query["expires"] = str(int(query["expires"]) + 3600)
    elif tamper == "sig":
        query["sig"] = query["sig"][:-2] + ("AA" if not query["sig"].endswith("AA") else "BB")
    elif tamper == "kid":
        query["kid"] = "k9"
    else:
        method = "DELETE"
    r = store.serve(method, path, query, {})
    assert r.status == 403 and b"url_bad_signature" in b"".join(r.body)


def test_expired_is_410(store):
    url = store.signed_url(KEY, 60, now=1_000_000).url
    assert get(store, url, now=1_000_030)[0] == 200
    status, _, body = get(store, url, now=1_000_061)
    assert status == 410 and b"url_expired" in body


def test_key_rotation(store, tmp_path):
    old = store.signed_url(KEY, 3600).url
    rotated = LocalStore(store.root, {"k2": b"secret-two", "k1": b"secret-one"}, current_key="k2")
    assert get(rotated, old)[0] == 200, "links signed with the previous key keep working"
    assert split(rotated.signed_url(KEY, 3600).url)[1]["kid"] == "k2"
    retired = LocalStore(store.root, {"k2": b"secret-two"})
    assert get(retired, old)[0] == 403, "once the old key is retired, its links stop working"


def test_ranges_and_resumed_download(store):
    url = store.signed_url(KEY, 3600).url
    status, headers, first = get(store, url, {"Range": "bytes=0-99999"})
    assert status == 206 and headers["Content-Range"] == f"bytes 0-99999/{len(DATA)}" and first == DATA[:100000]
    etag = headers["ETag"]
    status, headers, rest = get(store, url, {"Range": "bytes=100000-", "If-Range": etag})
    assert status == 206 and first + rest == DATA
    assert get(store, url, {"Range": "bytes=-10"})[2] == DATA[-10:]
    status, headers, body = get(store, url, {"Range": "bytes=100000-", "If-Range": '"stale"'})
    assert status == 200 and body == DATA, "a stale If-Range gets the whole file"
    status, headers, body = get(store, url, {"Range": f"bytes={len(DATA)}-"})
    assert status == 416 and headers["Content-Range"] == f"bytes */{len(DATA)}" and body == b""
    status, headers, body = get(store, url, method="HEAD")
    assert status == 200 and body == b"" and headers["Content-Length"] == str(len(DATA))


def test_missing_and_unsafe_keys(store):
    with pytest.raises(ExportError) as ei:
        store.signed_url("exports/op_123/nope.gguf", 60)
    assert ei.value.code == E.ARTIFACT_NOT_FOUND
    with pytest.raises(ExportError):
        store.path("../../etc/passwd")
    url = store.signed_url(KEY, 60).url
    store.path(KEY).unlink()
    assert get(store, url)[0] == 404


def test_s3_presigned_urls(monkeypatch, tmp_path):
    import requests
    from moto.server import ThreadedMotoServer

    for k, v in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        host, port = server.get_host_and_port()
        s3 = S3Store("exports", "prod", endpoint_url=f"http://{host}:{port}")
        s3.client.create_bucket(Bucket="exports")
        src = tmp_path / "src.bin"
        src.write_bytes(DATA)
        s3.put_file(src, KEY)
        assert s3.exists(KEY) and not s3.exists("exports/none")
        signed = s3.signed_url(KEY, 30 * 24 * 3600)
        assert signed.expires_at.timestamp() - time.time() <= S3_MAX_EXPIRY + 5, "capped at S3's 7 days"
        assert "prod/exports/op_123" in signed.url
        r = requests.get(signed.url, timeout=30)
        assert r.status_code == 200 and r.content == DATA
        assert "model-Q4_K_M.gguf" in r.headers.get("Content-Disposition", "")
    finally:
        server.stop()
