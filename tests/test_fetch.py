"""Fetching archives: file, HTTP with resume, S3 (moto's server), checks, cache, disk space."""

from __future__ import annotations

import hashlib
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from converters import errors as E
from converters.errors import ExportError
from exporter.fetch import ArchiveCache, fetch

BLOB = os.urandom(3 * (1 << 20) + 12345)
SHA = hashlib.sha256(BLOB).hexdigest()
ETAG = '"' + SHA[:16] + '"'


class _Handler(BaseHTTPRequestHandler):
    server_version = "test"

    def log_message(self, *a):
        pass

    def _status(self) -> int | None:
        return self.server.fail_with  # type: ignore[attr-defined]

    def do_HEAD(self):
        self.server.requests.append(("HEAD", None))  # type: ignore[attr-defined]
        if (code := self._status()) is not None:
            self.send_response(code)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(BLOB)))
        self.send_header("ETag", ETAG)
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()

    def do_GET(self):
        rng = self.headers.get("Range")
        self.server.requests.append(("GET", rng))  # type: ignore[attr-defined]
        if (code := self._status()) is not None:
            self.send_response(code)
            self.end_headers()
            return
        start = 0
        if rng and self.headers.get("If-Range", ETAG) == ETAG:
            start = int(rng.removeprefix("bytes=").split("-")[0])
        body = BLOB[start:]
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(BLOB) - 1}/{len(BLOB)}")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("ETag", ETAG)
        self.end_headers()
        cut = self.server.cut_after  # type: ignore[attr-defined]
        if cut is not None:  # drop the connection mid-body, once
            self.server.cut_after = None  # type: ignore[attr-defined]
            self.wfile.write(body[:cut])
            self.wfile.flush()
            self.connection.shutdown(2)
            return
        self.wfile.write(body)


@pytest.fixture
def http():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.requests, srv.fail_with, srv.cut_after = [], None, None
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv, f"http://127.0.0.1:{srv.server_address[1]}/ckpt.tar"
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def cache(tmp_path):
    return ArchiveCache(tmp_path / "cache")


def test_http_download_checked_and_cached(http, cache):
    srv, url = http
    got = fetch(url, cache, expected_sha256=SHA, expected_size=len(BLOB))
    assert got.path.read_bytes() == BLOB and got.sha256 == SHA and not got.cached
    assert got.path == cache.path(SHA) and list(cache.partial.iterdir()) == []
    n = len(srv.requests)
    again = fetch(url, cache, expected_sha256=SHA)
    assert again.cached and len(srv.requests) == n, "a cache hit makes no request"


def test_http_resumes_after_a_broken_connection(http, cache):
    srv, url = http
    srv.cut_after = 1 << 20
    with pytest.raises(ExportError) as ei:
        fetch(url, cache, expected_sha256=SHA)
    assert ei.value.code == E.FETCH_FAILED and ei.value.retryable
    assert cache.partial_for(url).stat().st_size == 1 << 20, "the received part is kept"
    assert cache.get(SHA) is None
    got = fetch(url, cache, expected_sha256=SHA)
    assert got.path.read_bytes() == BLOB
    assert ("GET", f"bytes={1 << 20}-") in srv.requests, "the retry asked only for the rest"


def test_http_errors(http, cache):
    srv, url = http
    srv.fail_with = 404
    with pytest.raises(ExportError) as ei:
        fetch(url, cache)
    assert ei.value.code == E.FETCH_NOT_FOUND and not ei.value.retryable
    srv.fail_with = 503
    with pytest.raises(ExportError) as ei:
        fetch(url, cache)
    assert ei.value.code == E.FETCH_FAILED and ei.value.retryable
    with pytest.raises(ExportError) as ei:
        fetch("http://127.0.0.1:9/nothing-listens-here", cache, timeout=2)
    assert ei.value.code == E.FETCH_FAILED


def test_checksum_mismatch_discards_the_download(http, cache):
    _, url = http
    with pytest.raises(ExportError) as ei:
        fetch(url, cache, expected_sha256="0" * 64)
    assert ei.value.code == E.ARCHIVE_CHECKSUM_MISMATCH
    assert list(cache.archives.iterdir()) == [] and list(cache.partial.iterdir()) == []


def test_not_enough_disk_space(http, cache, monkeypatch):
    srv, url = http
    real = os.statvfs

    class Tiny:
        f_bavail, f_frsize = 10, 4096

    monkeypatch.setattr(os, "statvfs", lambda p: Tiny() if str(p).startswith(str(cache.root)) else real(p))
    with pytest.raises(ExportError) as ei:
        fetch(url, cache)
    assert ei.value.code == E.DISK_FULL and ei.value.retryable
    assert not any(m == "GET" for m, _ in srv.requests), "nothing was downloaded"


def test_local_files(tmp_path, cache):
    src = tmp_path / "ckpt.tar"
    src.write_bytes(BLOB)
    for uri in (str(src), f"file://{src}"):
        got = fetch(uri, cache)
        assert got.sha256 == SHA and got.path.read_bytes() == BLOB
    with pytest.raises(ExportError) as ei:
        fetch(str(tmp_path / "missing.tar"), cache)
    assert ei.value.code == E.FETCH_NOT_FOUND
    with pytest.raises(ExportError) as ei:
        fetch("ftp://example.invalid/x.tar", cache)
    assert ei.value.code == E.FETCH_UNSUPPORTED


@pytest.fixture
def s3(monkeypatch):
    from moto.server import ThreadedMotoServer

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket="ckpts")
    client.put_object(Bucket="ckpts", Key="run_3Bz/000240.tar", Body=BLOB)
    yield endpoint
    server.stop()


def test_s3_download_and_resume(s3, cache):
    uri = "s3://ckpts/run_3Bz/000240.tar"
    part = cache.partial_for(uri)
    part.write_bytes(BLOB[: 1 << 20])  # left by an interrupted attempt
    seen = []
    got = fetch(uri, cache, expected_sha256=SHA, s3_endpoint_url=s3, progress=lambda d, t: seen.append(d))
    assert got.path.read_bytes() == BLOB
    assert seen[0] > 1 << 20 and seen[-1] == len(BLOB), "resumed from the partial file"
    with pytest.raises(ExportError) as ei:
        fetch("s3://ckpts/missing.tar", cache, s3_endpoint_url=s3)
    assert ei.value.code == E.FETCH_NOT_FOUND


def test_concurrent_fetches_of_one_uri_share_the_cache(tmp_path, cache):
    """Two jobs (threads or processes on one data dir) fetching the same archive at once: one downloads, both get it."""
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(8 << 20))
    sha = hashlib.sha256(src.read_bytes()).hexdigest()
    results, errors = [], []

    def one():
        try:
            results.append(fetch(src.as_uri(), cache, expected_sha256=sha))
        except Exception as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 4
    assert {r.path for r in results} == {cache.path(sha)} and sum(not r.cached for r in results) == 1
    assert not list(cache.partial.glob("*.part"))
