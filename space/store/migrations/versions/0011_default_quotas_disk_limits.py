"""default quotas and per-sandbox disk limits

A sandbox's disk limit (``sandboxes.disk_mb``); the largest one a tenant's sandbox may ask for
(``tenant_quotas.disk_mb``); and whether the operator ever set the tenant's limits
(``tenant_quotas.quota_set``): a tenant that never had them gets the defaults (the row of tenant
``*``). A row that already limits something had them set.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        batch.add_column(sa.Column("disk_mb", sa.Integer(), nullable=True))
    with op.batch_alter_table("tenant_quotas") as batch:
        batch.add_column(sa.Column("disk_mb", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("quota_set", sa.Boolean(), nullable=False, server_default=sa.false()))
    op.execute("UPDATE tenant_quotas SET quota_set = true WHERE sandboxes IS NOT NULL OR cpu IS NOT NULL "
               "OR memory_mb IS NOT NULL OR storage_mb IS NOT NULL")


def downgrade() -> None:
    with op.batch_alter_table("tenant_quotas") as batch:
        batch.drop_column("quota_set")
        batch.drop_column("disk_mb")
    with op.batch_alter_table("sandboxes") as batch:
        batch.drop_column("disk_mb")
