"""the HTTP service: tenants, API keys, idempotency, checkpoints, webhooks, export rules

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

TABLES = ("api_keys", "idempotency_keys", "checkpoints", "webhook_endpoints", "webhook_deliveries", "webhook_attempts", "export_rules", "dispatch_cursor")


def upgrade() -> None:
    with op.batch_alter_table("operations") as batch:
        batch.add_column(sa.Column("tenant", sa.String(64)))
        batch.add_column(sa.Column("checkpoint_id", sa.String(200)))
    op.create_index("ix_operations_tenant_created", "operations", ["tenant", "created_at"])
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("name", sa.String(200)),
        sa.Column("secret_sha256", sa.String(64), nullable=False),
        sa.Column("scopes", sa.JSON, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True)),
    )
    op.create_table(
        "idempotency_keys",
        sa.Column("tenant", sa.String(64), primary_key=True),
        sa.Column("key", sa.String(255), primary_key=True),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("state", sa.String(20), nullable=False),
        sa.Column("status_code", sa.Integer),
        sa.Column("body", sa.JSON),
        sa.Column("headers", sa.JSON),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "checkpoints",
        sa.Column("tenant", sa.String(64), primary_key=True),
        sa.Column("run_id", sa.String(200), primary_key=True),
        sa.Column("checkpoint_id", sa.String(200), primary_key=True),
        sa.Column("uri", sa.Text, nullable=False),
        sa.Column("sha256", sa.String(64)),
        sa.Column("size", sa.BigInteger),
        sa.Column("base_model", sa.String(300)),
        sa.Column("step", sa.Integer),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True)),
        sa.Column("expiring_notified_at", sa.DateTime(timezone=True)),
        sa.Column("deleted_at", sa.DateTime(timezone=True)),
    )
    op.create_index("ix_checkpoints_expires", "checkpoints", ["expires_at"])
    op.create_table(
        "webhook_endpoints",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("url", sa.Text, nullable=False),
        sa.Column("events", sa.JSON, nullable=False),
        sa.Column("secret_enc", sa.Text, nullable=False),
        sa.Column("enabled", sa.Integer, nullable=False),
        sa.Column("disabled_reason", sa.String(200)),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_webhook_endpoints_tenant", "webhook_endpoints", ["tenant"])
    op.create_table(
        "webhook_deliveries",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("endpoint_id", sa.String(40), sa.ForeignKey("webhook_endpoints.id", ondelete="CASCADE"), nullable=False),
        sa.Column("source", sa.String(120), nullable=False),
        sa.Column("event_type", sa.String(60), nullable=False),
        sa.Column("payload", sa.JSON, nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True)),
        sa.Column("lease_until", sa.DateTime(timezone=True)),
        sa.Column("last_status_code", sa.Integer),
        sa.Column("last_error", sa.String(500)),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("endpoint_id", "source", name="uq_webhook_deliveries_source"),
    )
    op.create_index("ix_webhook_deliveries_due", "webhook_deliveries", ["status", "next_attempt_at"])
    op.create_table(
        "webhook_attempts",
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("delivery_id", sa.String(40), sa.ForeignKey("webhook_deliveries.id", ondelete="CASCADE"), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("status_code", sa.Integer),
        sa.Column("error", sa.String(500)),
        sa.Column("duration_ms", sa.Integer),
    )
    op.create_index("ix_webhook_attempts_delivery", "webhook_attempts", ["delivery_id", "seq"])
    op.create_table(
        "export_rules",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("run_id", sa.String(200), nullable=False),
        sa.Column("formats", sa.JSON, nullable=False),
        sa.Column("destination", sa.String(20), nullable=False),
        sa.Column("hf_repo", sa.String(200)),
        sa.Column("every_n_steps", sa.Integer),
        sa.Column("options", sa.JSON),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_export_rules_run", "export_rules", ["run_id"])
    op.create_table(
        "dispatch_cursor",
        sa.Column("name", sa.String(40), primary_key=True),
        sa.Column("seq", sa.Integer, nullable=False),
    )


def downgrade() -> None:
    for name in reversed(TABLES):
        op.drop_table(name)
    op.drop_index("ix_operations_tenant_created", "operations")
    with op.batch_alter_table("operations") as batch:
        batch.drop_column("checkpoint_id")
        batch.drop_column("tenant")
