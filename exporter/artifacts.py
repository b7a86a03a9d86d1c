"""Artifact stores: where checkpoint archives and export outputs live, and how users download them.

- ``LocalStore``: a directory. Downloads go through HMAC-SHA256 signed URLs
  (method, path, expiry and key id are signed; several keys for rotation;
  constant-time comparison) served by ``LocalStore.serve`` with byte ranges,
  ``If-Range`` on a strong ETag (the file's sha256), 416, and
  Content-Disposition. ``serve`` is framework-free; the HTTP API mounts it.
- ``S3Store``: an S3-compatible bucket; downloads are presigned GET URLs (at
  most 7 days, S3's limit) with ``response-content-disposition``.

Keys are relative POSIX paths such as ``exports/op_…/model-Q4_K_M.gguf``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import shutil
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Iterator
from urllib.parse import quote, urlencode

from converters import errors as E
from converters.errors import ExportError
from converters.io.files import sha256_file

S3_MAX_EXPIRY = 7 * 24 * 3600
_CHUNK = 1 << 20


@dataclass(frozen=True)
class SignedUrl:
    url: str
    expires_at: datetime


@dataclass
class Response:
    """A framework-free HTTP response: status, headers, and a body iterator."""

    status: int
    headers: dict[str, str]
    body: Iterator[bytes]


def _safe_key(key: str) -> PurePosixPath:
    p = PurePosixPath(key)
    if p.is_absolute() or any(part in ("..", "") for part in p.parts) or not p.parts:
        raise ExportError(E.ARTIFACT_NOT_FOUND, f"{key!r} is not a valid artifact key.", field="key")
    return p


def content_disposition(filename: str) -> str:
    """attachment; with an ASCII fallback and the RFC 6266 / 5987 UTF-8 form."""
    ascii_name = filename.encode("ascii", "replace").decode().replace('"', "_").replace("?", "_")
    return f"attachment; filename=\"{ascii_name}\"; filename*=UTF-8''{quote(filename)}"


class LocalStore:
    def __init__(self, root: str | os.PathLike, keys: dict[str, bytes], *, current_key: str | None = None, base_url: str = "", route: str = "/v1/artifacts"):
        """``keys``: key id -> secret. URLs are signed with ``current_key``; any listed key verifies."""
        if not keys:
            raise ValueError("a local store needs at least one signing key")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.keys = dict(keys)
        self.current_key = current_key or next(iter(keys))
        self.base_url = base_url.rstrip("/")
        self.route = route.rstrip("/")

    def path(self, key: str) -> Path:
        return self.root.joinpath(*_safe_key(key).parts)

    def put_file(self, src: Path, key: str) -> Path:
        """Copy a file in atomically (temp + rename)."""
        dst = self.path(key)
        dst.parent.mkdir(parents=True, exist_ok=True)
        for stale in dst.parent.glob(f".{dst.name}.tmp-*"):  # a copy cut short by a killed worker
            stale.unlink(missing_ok=True)
        tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
        return dst

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def delete_prefix(self, prefix: str) -> None:
        """Remove every artifact under ``prefix`` (a folder key such as ``exports/op_…``)."""
        shutil.rmtree(self.path(prefix), ignore_errors=True)

    # --- signing ---------------------------------------------------------------------------

    def _signature(self, kid: str, method: str, path: str, expires: int) -> str:
        msg = f"{method.upper()}\n{path}\n{expires}\n{kid}".encode()
        return base64.urlsafe_b64encode(hmac.new(self.keys[kid], msg, hashlib.sha256).digest()).decode().rstrip("=")

    def signed_url(self, key: str, ttl_seconds: int, *, method: str = "GET", now: float | None = None) -> SignedUrl:
        if not self.exists(key):
            raise ExportError(E.ARTIFACT_NOT_FOUND, f"no artifact is stored under {key}.", field="key")
        expires = int((now if now is not None else time.time()) + ttl_seconds)
        path = f"{self.route}/{quote(str(_safe_key(key)))}"
        sig = self._signature(self.current_key, method, path, expires)
        query = urlencode({"expires": expires, "kid": self.current_key, "sig": sig})
        return SignedUrl(f"{self.base_url}{path}?{query}", datetime.fromtimestamp(expires, timezone.utc))

    def verify(self, method: str, path: str, query: dict[str, str], *, now: float | None = None) -> str:
        """Check a request against its signature; returns the artifact key."""
        kid, sig, expires = query.get("kid", ""), query.get("sig", ""), query.get("expires", "")
        if kid not in self.keys or not expires.isdigit() or not sig:
            raise ExportError(E.URL_BAD_SIGNATURE, "this download link is not valid; ask for a new one.")
        # HEAD is a GET without the body: a GET link works for both
        methods = ("GET", "HEAD") if method.upper() in ("GET", "HEAD") else (method.upper(),)
        if not any(hmac.compare_digest(self._signature(kid, m, path, int(expires)), sig) for m in methods):
            raise ExportError(E.URL_BAD_SIGNATURE, "this download link is not valid; ask for a new one.")
        if (now if now is not None else time.time()) > int(expires):
            raise ExportError(E.URL_EXPIRED, "this download link has expired; ask for a new one.")
        if not path.startswith(self.route + "/"):
            raise ExportError(E.URL_BAD_SIGNATURE, "this download link is not valid; ask for a new one.")
        from urllib.parse import unquote

        return unquote(path[len(self.route) + 1 :])

    # --- serving ---------------------------------------------------------------------------

    def etag(self, key: str) -> str:
        """Strong ETag: the file's sha256, kept in a sidecar so it is computed once."""
        p = self.path(key)
        side = p.with_name(f".{p.name}.sha256")
        st = p.stat()
        stamp = f"{st.st_size}:{st.st_mtime_ns}"
        if side.is_file():
            cached_stamp, _, digest = side.read_text().partition(" ")
            if cached_stamp == stamp:
                return f'"{digest}"'
        digest = sha256_file(p)
        side.write_text(f"{stamp} {digest}")
        return f'"{digest}"'

    def serve(self, method: str, path: str, query: dict[str, str], headers: dict[str, str], *, now: float | None = None) -> Response:
        """Answer a download request: 200/206/416, 403 bad signature, 410 expired, 404 missing."""
        h = {k.lower(): v for k, v in headers.items()}
        try:
            key = self.verify(method, path, query, now=now)
        except ExportError as exc:
            return _error(410 if exc.code == E.URL_EXPIRED else 403, exc)
        p = self.path(key)
        if not p.is_file():
            return _error(404, ExportError(E.ARTIFACT_NOT_FOUND, "the artifact behind this link no longer exists."))
        size = p.stat().st_size
        etag = self.etag(key)
        base = {"Accept-Ranges": "bytes", "ETag": etag, "Content-Disposition": content_disposition(p.name), "Content-Type": "application/octet-stream", "Cache-Control": "private, no-transform"}
        rng = h.get("range")
        if rng and "if-range" in h and h["if-range"] != etag:
            rng = None  # the client's copy is stale: send the whole file
        if rng:
            span = _parse_range(rng, size)
            if span is None:
                return Response(416, {**base, "Content-Range": f"bytes */{size}", "Content-Length": "0"}, iter(()))
            start, end = span
            return Response(206, {**base, "Content-Range": f"bytes {start}-{end}/{size}", "Content-Length": str(end - start + 1)},
                            iter(()) if method.upper() == "HEAD" else _read(p, start, end))
        return Response(200, {**base, "Content-Length": str(size)}, iter(()) if method.upper() == "HEAD" else _read(p, 0, size - 1))


def _error(status: int, exc: ExportError) -> Response:
    import json

    body = json.dumps({"error": exc.to_dict()}).encode()
    return Response(status, {"Content-Type": "application/json", "Content-Length": str(len(body))}, iter((body,)))


def _parse_range(value: str, size: int) -> tuple[int, int] | None:
    """One 'bytes=' range -> inclusive (start, end), or None when unsatisfiable or malformed."""
    unit, _, spec = value.partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None
    first, _, last = spec.strip().partition("-")
    try:
        if first == "":  # suffix: the last N bytes
            n = int(last)
            return (max(0, size - n), size - 1) if n > 0 and size else None
        start = int(first)
        end = int(last) if last else size - 1
    except ValueError:
        return None
    if start >= size or end < start:
        return None
    return start, min(end, size - 1)


def _read(p: Path, start: int, end: int) -> Iterator[bytes]:
    with open(p, "rb") as f:
        f.seek(start)
        left = end - start + 1
        while left > 0:
            b = f.read(min(_CHUNK, left))
            if not b:
                return
            left -= len(b)
            yield b


class S3Store:
    def __init__(self, bucket: str, prefix: str = "", *, endpoint_url: str | None = None):
        import boto3

        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.client = boto3.client("s3", endpoint_url=endpoint_url)

    def _key(self, key: str) -> str:
        k = str(_safe_key(key))
        return f"{self.prefix}/{k}" if self.prefix else k

    def put_file(self, src: Path, key: str) -> str:
        self.client.upload_file(str(src), self.bucket, self._key(key))
        return self._key(key)

    def exists(self, key: str) -> bool:
        import botocore.exceptions

        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except botocore.exceptions.ClientError:
            return False

    def delete_prefix(self, prefix: str) -> None:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._key(prefix).rstrip("/") + "/")
        for page in pages:
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys})

    def signed_url(self, key: str, ttl_seconds: int, *, now: float | None = None) -> SignedUrl:
        ttl = min(int(ttl_seconds), S3_MAX_EXPIRY)
        params = {"Bucket": self.bucket, "Key": self._key(key), "ResponseContentDisposition": content_disposition(PurePosixPath(key).name)}
        url = self.client.generate_presigned_url("get_object", Params=params, ExpiresIn=ttl)
        return SignedUrl(url, datetime.fromtimestamp(int((now if now is not None else time.time()) + ttl), timezone.utc))
