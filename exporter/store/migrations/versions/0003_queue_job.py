"""operations.job_id: the procrastinate job that carries an operation (distributed mode)

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("operations") as batch:
        batch.add_column(sa.Column("job_id", sa.BigInteger))


def downgrade() -> None:
    with op.batch_alter_table("operations") as batch:
        batch.drop_column("job_id")
