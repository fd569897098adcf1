"""tenant_quotas.backup_every: a tenant's continuous-backup interval, between the deployment's
default and a sandbox's own policy (NULL: the deployment's; 0: off)

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("tenant_quotas") as batch:
        batch.add_column(sa.Column("backup_every", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenant_quotas") as batch:
        batch.drop_column("backup_every")
