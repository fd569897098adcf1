"""the private ranges the operator opens to a tenant (its egress ceiling)

Revision ID: egress_0001
Revises: e2b_0001
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "egress_0001"
down_revision: str | None = "e2b_0001"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("tenant_quotas") as batch:
        batch.add_column(sa.Column("egress_ceiling", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenant_quotas") as batch:
        batch.drop_column("egress_ceiling")
