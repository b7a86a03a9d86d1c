"""Small helpers the store modules share."""

from __future__ import annotations

from datetime import datetime, timezone


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def aware(d: datetime | None) -> datetime | None:
    # SQLite hands timestamps back naive; everything we store is UTC
    return d.replace(tzinfo=timezone.utc) if d is not None and d.tzinfo is None else d


def insert_ignore(engine, table):
    """INSERT … ON CONFLICT DO NOTHING for the dialect in use (SQLite and PostgreSQL both have it)."""
    if engine.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    return insert(table).on_conflict_do_nothing()
