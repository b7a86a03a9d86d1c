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
    # the API key owner it belongs to, and the checkpoint it exports (migration 0002)
    Column("tenant", String(64)),
    Column("checkpoint_id", String(200)),
    Column("job_id", BigInteger),  # the procrastinate job carrying it, in distributed mode (migration 0003)
    UniqueConstraint("idempotency_key", name="uq_operations_idempotency_key"),
    Index("ix_operations_status_created", "status", "created_at"),
    Index("ix_operations_run_id", "run_id"),
    Index("ix_operations_tenant_created", "tenant", "created_at"),
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

# --- the HTTP service (migration 0002) ---------------------------------------------------------

api_keys = Table(
    "api_keys",
    metadata,
    Column("id", String(40), primary_key=True),  # the public part of the key: nxk_<id>_<secret>
    Column("tenant", String(64), nullable=False),
    Column("name", String(200)),
    Column("secret_sha256", String(64), nullable=False),  # only a hash of the secret is kept
    Column("scopes", JSON, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("revoked_at", DateTime(timezone=True)),
)

idempotency_keys = Table(
    "idempotency_keys",
    metadata,
    Column("tenant", String(64), primary_key=True),
    Column("key", String(255), primary_key=True),
    Column("fingerprint", String(64), nullable=False),
    Column("state", String(20), nullable=False),  # processing | done
    Column("status_code", Integer),
    Column("body", JSON),
    Column("headers", JSON),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("expires_at", DateTime(timezone=True), nullable=False),
)

checkpoints = Table(
    "checkpoints",
    metadata,
    Column("tenant", String(64), primary_key=True),
    Column("run_id", String(200), primary_key=True),
    Column("checkpoint_id", String(200), primary_key=True),
    Column("uri", Text, nullable=False),
    Column("sha256", String(64)),
    Column("size", BigInteger),
    Column("base_model", String(300)),
    Column("step", Integer),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("expires_at", DateTime(timezone=True)),
    Column("expiring_notified_at", DateTime(timezone=True)),
    Column("deleted_at", DateTime(timezone=True)),
    Index("ix_checkpoints_expires", "expires_at"),
)

webhook_endpoints = Table(
    "webhook_endpoints",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("tenant", String(64), nullable=False),
    Column("url", Text, nullable=False),
    Column("events", JSON, nullable=False),
    Column("secret_enc", Text, nullable=False),  # AES-GCM under the server key: never stored in the clear
    Column("enabled", Integer, nullable=False),
    Column("disabled_reason", String(200)),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Index("ix_webhook_endpoints_tenant", "tenant"),
)

webhook_deliveries = Table(
    "webhook_deliveries",
    metadata,
    Column("id", String(40), primary_key=True),  # the Standard Webhooks message id (webhook-id), same on every retry
    Column("endpoint_id", String(40), ForeignKey("webhook_endpoints.id", ondelete="CASCADE"), nullable=False),
    Column("source", String(120), nullable=False),  # what caused it (an operation event, a checkpoint notice): deduplicates fan-out
    Column("event_type", String(60), nullable=False),
    Column("payload", JSON, nullable=False),
    Column("status", String(20), nullable=False),  # pending | succeeded | failed
    Column("attempts", Integer, nullable=False),
    Column("next_attempt_at", DateTime(timezone=True)),
    Column("lease_until", DateTime(timezone=True)),
    Column("last_status_code", Integer),
    Column("last_error", String(500)),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False),
    UniqueConstraint("endpoint_id", "source", name="uq_webhook_deliveries_source"),
    Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),
)

webhook_attempts = Table(
    "webhook_attempts",
    metadata,
    Column("seq", Integer, primary_key=True, autoincrement=True),
    Column("delivery_id", String(40), ForeignKey("webhook_deliveries.id", ondelete="CASCADE"), nullable=False),
    Column("at", DateTime(timezone=True), nullable=False),
    Column("status_code", Integer),
    Column("error", String(500)),
    Column("duration_ms", Integer),
    Index("ix_webhook_attempts_delivery", "delivery_id", "seq"),
)

export_rules = Table(
    "export_rules",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("tenant", String(64), nullable=False),
    Column("run_id", String(200), nullable=False),
    Column("formats", JSON, nullable=False),
    Column("destination", String(20), nullable=False),
    Column("hf_repo", String(200)),
    Column("every_n_steps", Integer),
    Column("options", JSON),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Index("ix_export_rules_run", "run_id"),
)

dispatch_cursor = Table(
    "dispatch_cursor",
    metadata,
    Column("name", String(40), primary_key=True),
    Column("seq", Integer, nullable=False),  # operation_events turned into webhook deliveries up to here
)
