"""Where checkpoint archives may live, and which of them are ours.

Through the API a tenant may register an archive only from its own part of
the artifact store (``checkpoints/<tenant>/…``, locally or in the store's S3
bucket), from a configured archive root or bucket (``ARCHIVE_ROOTS``,
``ARCHIVE_BUCKETS``), or over http(s). Anything else is refused: otherwise a
key could make the workers read another tenant's archive, an export, or any
file or bucket the workers can reach. Archives the trainer announces through
the signed checkpoint-saved hook come from the platform itself and are trusted.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple
from urllib.parse import unquote, urlsplit

from converters import errors as E
from converters.errors import ExportError

from .artifacts import LocalStore, S3Store


class Owned(NamedTuple):
    kind: str  # "local" or "s3"
    location: object  # the file's Path, or the object's full S3 key
    key: str  # the artifact store's key (what signed_url takes)


def owned_location(uri: str, artifacts) -> Owned | None:
    """Where ``uri`` lies in our artifact store, or None when it is elsewhere."""
    u = urlsplit(uri)
    if isinstance(artifacts, LocalStore) and u.scheme in ("", "file"):
        p = Path(unquote(u.path)).resolve()
        root = artifacts.root.resolve()
        if root in p.parents:
            return Owned("local", p, p.relative_to(root).as_posix())
    if isinstance(artifacts, S3Store) and u.scheme == "s3" and u.netloc == artifacts.bucket:
        key = u.path.lstrip("/")
        if not artifacts.prefix:
            return Owned("s3", key, key)
        if key.startswith(artifacts.prefix + "/"):
            return Owned("s3", key, key[len(artifacts.prefix) + 1:])
    return None


def tenant_prefix(tenant: str) -> str:
    return f"checkpoints/{tenant}/"


def check_registrable(uri: str, tenant: str, artifacts, *, roots: list[Path] = (), buckets: list[str] = ()) -> None:
    u = urlsplit(uri)
    refused = ExportError(E.ARCHIVE_URI_REFUSED, f"{uri.split('?')[0]} is not a place this key may register archives from; upload it under "
                                                 f"{tenant_prefix(tenant)} in the artifact store, or ask the operator to allow its root or bucket.", field="uri")
    if u.scheme in ("http", "https"):
        return
    if u.scheme == "s3":
        if isinstance(artifacts, S3Store) and u.netloc == artifacts.bucket:
            own = (artifacts.prefix + "/" if artifacts.prefix else "") + tenant_prefix(tenant)
            if u.path.lstrip("/").startswith(own) and ".." not in u.path.split("/"):
                return
            raise refused
        if u.netloc in buckets:
            return
        raise refused
    if u.scheme in ("file", ""):
        p = Path(unquote(u.path)).resolve()
        allowed = [Path(r).resolve() for r in roots]
        if isinstance(artifacts, LocalStore):
            allowed.append((artifacts.root / tenant_prefix(tenant)).resolve())
        if any(root in p.parents for root in allowed):
            return
        raise refused
    raise ExportError(E.FETCH_UNSUPPORTED, f"archive URI scheme {u.scheme!r} is not supported; use s3://, https:// or file://.", field="uri")
