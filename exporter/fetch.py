"""Fetching checkpoint archives into a local cache keyed by sha256.

Sources: local paths and ``file://``, ``http(s)://`` (streamed to disk,
resumed with ``Range`` + ``If-Range`` after an interruption), and ``s3://``
(boto3, with a configurable endpoint, resumed the same way). A download lands
in ``partial/`` under a name derived from the URI and moves into
``archives/<sha256>`` only when complete and checked, so the cache never
holds a half-written or unverified archive. Free disk space is checked before
a byte is downloaded. Fetches of one URI take turns under a file lock, so
workers sharing a data dir (threads or processes) download it once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator
from urllib.parse import unquote, urlparse

from converters import errors as E
from converters.errors import ExportError
from converters.io.files import check_free_space, sha256_file

_CHUNK = 256 << 10  # also the progress granularity of a download

ProgressFn = Callable[[int, int], None]  # bytes done, bytes total (0: unknown)


@dataclass(frozen=True)
class Fetched:
    path: Path
    sha256: str
    size: int
    cached: bool  # already in the cache, nothing downloaded


class ArchiveCache:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.archives = self.root / "archives"
        self.partial = self.root / "partial"
        self.locks = self.root / "locks"  # kept: removing a lock file under a waiter would let two fetchers in
        for d in (self.archives, self.partial, self.locks):
            d.mkdir(parents=True, exist_ok=True)

    def path(self, sha256: str) -> Path:
        return self.archives / sha256.lower()

    def get(self, sha256: str) -> Path | None:
        p = self.path(sha256)
        return p if p.is_file() else None

    def partial_for(self, uri: str) -> Path:
        return self.partial / (hashlib.sha256(uri.encode()).hexdigest()[:32] + ".part")

    @contextlib.contextmanager
    def lock(self, uri: str, waiting: Callable[[], None] | None = None) -> Iterator[None]:
        """One fetch of ``uri`` at a time, across the threads and processes sharing this cache
        (they share its partial file). ``waiting`` is called while another holds it (a cancel check)."""
        with open(self.locks / self.partial_for(uri).with_suffix(".lock").name, "a+") as fh:
            while True:
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if waiting:
                        waiting()
                    time.sleep(0.1)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def adopt(self, tmp: Path, sha256: str) -> Path:
        """Move a complete, checked file into the cache (atomic rename)."""
        dst = self.path(sha256)
        os.replace(tmp, dst)
        return dst


def _finish(cache: ArchiveCache, part: Path, expected_sha256: str | None, expected_size: int | None) -> Fetched:
    size = part.stat().st_size
    if expected_size is not None and size != expected_size:
        part.unlink(missing_ok=True)
        raise ExportError(E.ARCHIVE_SIZE_MISMATCH, f"the downloaded archive is {size} bytes but {expected_size} were expected; it was discarded.")
    sha = sha256_file(part)
    if expected_sha256 and sha != expected_sha256.lower():
        part.unlink(missing_ok=True)
        raise ExportError(E.ARCHIVE_CHECKSUM_MISMATCH, "the downloaded archive does not match its expected sha256; it was discarded.")
    return Fetched(cache.adopt(part, sha), sha, size, cached=False)


def fetch(uri: str, cache: ArchiveCache, *, expected_sha256: str | None = None, expected_size: int | None = None,
          s3_endpoint_url: str | None = None, timeout: float = 60.0, progress: ProgressFn | None = None) -> Fetched:
    """Bring ``uri`` into the cache (or find it there) and return where it is."""
    if expected_sha256 and (hit := cache.get(expected_sha256)):
        return Fetched(hit, expected_sha256.lower(), hit.stat().st_size, cached=True)
    with cache.lock(uri, (lambda: progress(0, 0)) if progress else None):
        if expected_sha256 and (hit := cache.get(expected_sha256)):  # fetched by whoever held the lock
            return Fetched(hit, expected_sha256.lower(), hit.stat().st_size, cached=True)
        return _fetch_uncached(uri, cache, expected_sha256, expected_size, s3_endpoint_url, timeout, progress)


def _fetch_uncached(uri, cache, expected_sha256, expected_size, s3_endpoint_url, timeout, progress) -> Fetched:
    scheme = urlparse(uri).scheme
    if scheme in ("", "file"):
        return _fetch_file(uri, cache, expected_sha256, expected_size)
    if scheme in ("http", "https"):
        return _fetch_ranged(uri, cache, _HttpSource(uri, timeout), expected_sha256, expected_size, progress)
    if scheme == "s3":
        return _fetch_ranged(uri, cache, _S3Source(uri, s3_endpoint_url), expected_sha256, expected_size, progress)
    raise ExportError(E.FETCH_UNSUPPORTED, f"cannot fetch {scheme}:// URIs; use file://, http(s):// or s3://.", field="uri")


def _fetch_file(uri: str, cache: ArchiveCache, expected_sha256, expected_size) -> Fetched:
    path = Path(unquote(urlparse(uri).path) if uri.startswith("file://") else uri)
    if not path.is_file():
        raise ExportError(E.FETCH_NOT_FOUND, f"{path} does not exist or is not a file.", field="uri")
    check_free_space(cache.root, path.stat().st_size, "the archive")
    part = cache.partial_for(uri)
    shutil.copyfile(path, part)  # a private copy: the source may change or vanish later
    return _finish(cache, part, expected_sha256, expected_size)


class _HttpSource:
    def __init__(self, url: str, timeout: float):
        import requests

        self.url, self.timeout, self.requests = url, timeout, requests
        self.session = requests.Session()

    def _raise(self, status: int) -> None:
        if status in (401, 403, 404, 410):
            raise ExportError(E.FETCH_NOT_FOUND, f"{self.url} answered HTTP {status}; check the URI or its signature.", field="uri")
        raise ExportError(E.FETCH_FAILED, f"{self.url} answered HTTP {status}; retry later.")

    def head(self) -> tuple[int, str | None]:
        """(size or 0, validator for If-Range)."""
        try:
            r = self.session.head(self.url, timeout=self.timeout, allow_redirects=True)
        except self.requests.RequestException as exc:
            raise ExportError(E.FETCH_FAILED, f"could not reach {self.url} ({exc.__class__.__name__}); retry later.") from None
        if r.status_code >= 400:
            self._raise(r.status_code)
        return int(r.headers.get("Content-Length") or 0), r.headers.get("ETag") or r.headers.get("Last-Modified")

    def read(self, start: int, validator: str | None) -> tuple[bool, Iterator[bytes]]:
        """(resumed?, chunks). Resumes at ``start`` if the server still serves the same object."""
        headers = {"Range": f"bytes={start}-", **({"If-Range": validator} if validator else {})} if start else {}
        try:
            r = self.session.get(self.url, headers=headers, stream=True, timeout=self.timeout)
        except self.requests.RequestException as exc:
            raise ExportError(E.FETCH_FAILED, f"could not reach {self.url} ({exc.__class__.__name__}); retry later.") from None
        if r.status_code >= 400 and r.status_code != 416:
            self._raise(r.status_code)
        if r.status_code == 416:  # already complete
            return True, iter(())

        def chunks():
            try:
                yield from r.iter_content(_CHUNK)
            except self.requests.RequestException as exc:
                raise ExportError(E.FETCH_FAILED, f"the download from {self.url} broke off ({exc.__class__.__name__}); it resumes on retry.") from None

        return r.status_code == 206, chunks()


class _S3Source:
    def __init__(self, uri: str, endpoint_url: str | None):
        import boto3
        import botocore.exceptions

        u = urlparse(uri)
        self.bucket, self.key = u.netloc, u.path.lstrip("/")
        self.client = boto3.client("s3", endpoint_url=endpoint_url)
        self.errors = botocore.exceptions

    def _raise(self, exc) -> None:
        code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
        if code in ("404", "NoSuchKey", "NoSuchBucket", "403", "AccessDenied"):
            raise ExportError(E.FETCH_NOT_FOUND, f"s3://{self.bucket}/{self.key} is not accessible ({code}).", field="uri") from None
        raise ExportError(E.FETCH_FAILED, f"reading s3://{self.bucket}/{self.key} failed ({code or exc.__class__.__name__}); retry later.") from None

    def head(self) -> tuple[int, str | None]:
        try:
            h = self.client.head_object(Bucket=self.bucket, Key=self.key)
        except (self.errors.ClientError, self.errors.BotoCoreError) as exc:
            self._raise(exc)
        return int(h["ContentLength"]), h.get("ETag")

    def read(self, start: int, validator: str | None) -> tuple[bool, Iterator[bytes]]:
        kwargs = {"Range": f"bytes={start}-", **({"IfMatch": validator} if validator else {})} if start else {}
        try:
            obj = self.client.get_object(Bucket=self.bucket, Key=self.key, **kwargs)
        except (self.errors.ClientError, self.errors.BotoCoreError) as exc:
            if start and str(getattr(exc, "response", {}).get("Error", {}).get("Code", "")) in ("PreconditionFailed", "412"):
                return self.read(0, None)  # the object changed: start over
            self._raise(exc)
        return bool(start), obj["Body"].iter_chunks(_CHUNK)


def _fetch_ranged(uri: str, cache: ArchiveCache, source, expected_sha256, expected_size, progress) -> Fetched:
    size, validator = source.head()
    part = cache.partial_for(uri)
    have = part.stat().st_size if part.exists() else 0
    if size and have > size:
        part.unlink()
        have = 0
    check_free_space(cache.root, max(0, (size or expected_size or 0) - have), "the archive")
    resumed, chunks = source.read(have, validator)
    done = have if resumed else 0
    with open(part, "ab" if resumed else "wb") as f:
        for chunk in chunks:
            f.write(chunk)
            done += len(chunk)
            if progress:
                progress(done, size)
        f.flush()
        os.fsync(f.fileno())
    if size and done != size:
        raise ExportError(E.FETCH_FAILED, f"the download of {uri} stopped at {done} of {size} bytes; it resumes on retry.")
    return _finish(cache, part, expected_sha256, expected_size)
