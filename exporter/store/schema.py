"""The operations store's tables (SQLAlchemy Core). Changes go through Alembic migrations."""

from __future__ import annotations

from sqlalchemy import JSON, BigInteger, Column, DateTime, Float, ForeignKey, Index, Integer, MetaData, String, Table, Text, UniqueConstraint

metadata = MetaData()

operations = Table(
    "operations",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("type", String(20), nullable=False),
    Column("status", String(20), nullable=False),
    Column("stage", String(20)),
    Column("percent", Float),
    Column("bytes_done", BigInteger),
    Column("bytes_total", BigInteger),
    Column("eta_seconds", Float),
    Column("message", String(500)),
    Column("request", JSON, nullable=False),
    Column("result", JSON),
    Column("error_code", String(64)),
    Column("error_message", Text),
    Column("attempts", Integer, nullable=False, default=0),
    Column("idempotency_key", String(255)),
    Column("fingerprint", String(64), nullable=False),
    # filters the API lists by, copied out of the request
    Column("run_id", String(200)),
    Column("format", String(40)),
    # the lease of the worker running it
    Column("worker_id", String(100)),
    Column("lease_expires_at", DateTime(timezone=True)),
    Column("available_at", DateTime(timezone=True), nullable=False),  # retry backoff: not claimed before
    Column("version", Integer, nullable=False),  # optimistic locking: every update checks and bumps it
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("started_at", DateTime(timezone=True)),
    Column("updated_at", DateTime(timezone=True), nullable=False),
    Column("finished_at", DateTime(timezone=True)),
    UniqueConstraint("idempotency_key", name="uq_operations_idempotency_key"),
    Index("ix_operations_status_created", "status", "created_at"),
    Index("ix_operations_run_id", "run_id"),
)

operation_events = Table(
    "operation_events",
    metadata,
    Column("seq", Integer, primary_key=True, autoincrement=True),
    Column("operation_id", String(40), ForeignKey("operations.id", ondelete="CASCADE"), nullable=False),
    Column("at", DateTime(timezone=True), nullable=False),
    Column("kind", String(40), nullable=False),
    Column("data", JSON),
    Index("ix_operation_events_op", "operation_id", "seq"),
)
