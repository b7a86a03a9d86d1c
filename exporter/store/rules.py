"""Export rules: which exports a run's new checkpoints start by themselves."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, insert, select

from converters import errors as E
from converters.errors import ExportError

from .schema import export_rules as T
from .util import aware, utcnow


@dataclass(frozen=True)
class ExportRule:
    id: str
    tenant: str
    run_id: str
    formats: list[str]
    destination: str
    hf_repo: str | None
    every_n_steps: int | None
    options: dict | None
    created_at: datetime

    def applies_to(self, step: int | None) -> bool:
        return not self.every_n_steps or (step is not None and step % self.every_n_steps == 0)

    def to_dict(self) -> dict:
        return {"id": self.id, "run_id": self.run_id, "formats": self.formats, "destination": self.destination, "hf_repo": self.hf_repo,
                "every_n_steps": self.every_n_steps, "options": self.options or {}, "created_at": self.created_at.isoformat()}


def _row(r) -> ExportRule:
    d = dict(r._mapping)
    d["created_at"] = aware(d["created_at"])
    return ExportRule(**d)


class ExportRules:
    def __init__(self, engine):
        self.engine = engine

    def create(self, tenant: str, run_id: str, *, formats: list[str], destination: str, hf_repo: str | None, every_n_steps: int | None, options: dict | None) -> ExportRule:
        rule_id = "rule_" + secrets.token_hex(8)
        with self.engine.begin() as conn:
            conn.execute(insert(T).values(id=rule_id, tenant=tenant, run_id=run_id, formats=formats, destination=destination, hf_repo=hf_repo,
                                          every_n_steps=every_n_steps, options=options, created_at=utcnow()))
        return self.get(tenant, rule_id)

    def get(self, tenant: str, rule_id: str) -> ExportRule:
        with self.engine.connect() as conn:
            r = conn.execute(select(T).where(T.c.tenant == tenant, T.c.id == rule_id)).first()
        if r is None:
            raise ExportError(E.RULE_NOT_FOUND, f"export rule {rule_id} does not exist.", field="rule_id")
        return _row(r)

    def list(self, tenant: str | None, run_id: str) -> list[ExportRule]:
        q = select(T).where(T.c.run_id == run_id).order_by(T.c.created_at, T.c.id)
        if tenant is not None:
            q = q.where(T.c.tenant == tenant)
        with self.engine.connect() as conn:
            return [_row(r) for r in conn.execute(q)]

    def delete(self, tenant: str, rule_id: str) -> None:
        with self.engine.begin() as conn:
            if conn.execute(delete(T).where(T.c.tenant == tenant, T.c.id == rule_id)).rowcount != 1:
                raise ExportError(E.RULE_NOT_FOUND, f"export rule {rule_id} does not exist.", field="rule_id")
