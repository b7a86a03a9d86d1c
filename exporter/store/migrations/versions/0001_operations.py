"""operations and their event log

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "operations",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("type", sa.String(20), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("stage", sa.String(20)),
        sa.Column("percent", sa.Float),
        sa.Column("bytes_done", sa.BigInteger),
        sa.Column("bytes_total", sa.BigInteger),
        sa.Column("eta_seconds", sa.Float),
        sa.Column("message", sa.String(500)),
        sa.Column("request", sa.JSON, nullable=False),
        sa.Column("result", sa.JSON),
        sa.Column("error_code", sa.String(64)),
        sa.Column("error_message", sa.Text),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("idempotency_key", sa.String(255)),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("run_id", sa.String(200)),
        sa.Column("format", sa.String(40)),
        sa.Column("worker_id", sa.String(100)),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True)),
        sa.Column("available_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True)),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True)),
        sa.UniqueConstraint("idempotency_key", name="uq_operations_idempotency_key"),
    )
    op.create_index("ix_operations_status_created", "operations", ["status", "created_at"])
    op.create_index("ix_operations_run_id", "operations", ["run_id"])
    op.create_table(
        "operation_events",
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("operation_id", sa.String(40), sa.ForeignKey("operations.id", ondelete="CASCADE"), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("kind", sa.String(40), nullable=False),
        sa.Column("data", sa.JSON),
    )
    op.create_index("ix_operation_events_op", "operation_events", ["operation_id", "seq"])


def downgrade() -> None:
    op.drop_table("operation_events")
    op.drop_table("operations")
