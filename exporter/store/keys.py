"""API keys: ``nxk_<id>_<secret>``, shown once; only a SHA-256 of the secret is stored.

The secret is 256 random bits, so a plain hash is enough (no slow KDF needed:
there is nothing to brute-force), and the comparison is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import insert, select, update

from .schema import api_keys
from .util import aware, utcnow

SCOPES = ("read", "train", "infer")
_KEY = re.compile(r"nxk_([0-9a-f]{16})_([A-Za-z0-9_-]{43})")


@dataclass(frozen=True)
class ApiKey:
    id: str
    tenant: str
    name: str | None
    scopes: tuple[str, ...]
    created_at: datetime
    revoked_at: datetime | None

    def to_dict(self) -> dict:
        return {"id": self.id, "tenant": self.tenant, "name": self.name, "scopes": list(self.scopes), "created_at": self.created_at.isoformat(),
                "revoked_at": self.revoked_at.isoformat() if self.revoked_at else None}


def _row(r) -> ApiKey:
    return ApiKey(r.id, r.tenant, r.name, tuple(r.scopes), aware(r.created_at), aware(r.revoked_at))


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class ApiKeys:
    def __init__(self, engine):
        self.engine = engine

    def create(self, tenant: str, scopes: list[str], name: str | None = None) -> tuple[ApiKey, str]:
        """(the key's record, the full key). The full key is never stored: show it once."""
        bad = [s for s in scopes if s not in SCOPES]
        if bad or not scopes:
            raise ValueError(f"scopes must be some of {', '.join(SCOPES)}; got {', '.join(scopes) or 'none'}")
        key_id, secret = secrets.token_hex(8), secrets.token_urlsafe(32)
        with self.engine.begin() as conn:
            conn.execute(insert(api_keys).values(id=key_id, tenant=tenant, name=name, secret_sha256=_hash(secret), scopes=sorted(set(scopes)), created_at=utcnow()))
        return self.get(key_id), f"nxk_{key_id}_{secret}"

    def get(self, key_id: str) -> ApiKey | None:
        with self.engine.connect() as conn:
            r = conn.execute(select(api_keys).where(api_keys.c.id == key_id)).first()
        return _row(r) if r else None

    def authenticate(self, token: str) -> ApiKey | None:
        m = _KEY.fullmatch(token or "")
        if not m:
            return None
        with self.engine.connect() as conn:
            r = conn.execute(select(api_keys).where(api_keys.c.id == m.group(1))).first()
        if r is None or r.revoked_at is not None or not hmac.compare_digest(r.secret_sha256, _hash(m.group(2))):
            return None
        return _row(r)

    def revoke(self, key_id: str) -> bool:
        with self.engine.begin() as conn:
            return conn.execute(update(api_keys).where(api_keys.c.id == key_id, api_keys.c.revoked_at.is_(None)).values(revoked_at=utcnow())).rowcount == 1

    def list(self, tenant: str | None = None) -> list[ApiKey]:
        q = select(api_keys).order_by(api_keys.c.created_at)
        if tenant:
            q = q.where(api_keys.c.tenant == tenant)
        with self.engine.connect() as conn:
            return [_row(r) for r in conn.execute(q)]
