"""the private ranges the operator opens to a tenant (its egress ceiling)

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("tenant_quotas") as batch:
        batch.add_column(sa.Column("egress_ceiling", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenant_quotas") as batch:
        batch.drop_column("egress_ceiling")
