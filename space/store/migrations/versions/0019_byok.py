"""Bring your own key: the shred secrets snapshots' keys are made with (sandboxes.shred for a
sandbox's own snapshots and backups, snapshots.shred for a retained snapshot, which outlives its
sandbox; '' once destroyed), and a tenant's key-encryption key (tenant_quotas.key_provider,
key_id; NULL: the deployment's)

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        batch.add_column(sa.Column("shred", sa.String(64), nullable=True))
    with op.batch_alter_table("snapshots") as batch:
        batch.add_column(sa.Column("shred", sa.String(64), nullable=True))
    with op.batch_alter_table("tenant_quotas") as batch:
        batch.add_column(sa.Column("key_provider", sa.String(16), nullable=True))
        batch.add_column(sa.Column("key_id", sa.String(2048), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenant_quotas") as batch:
        batch.drop_column("key_id")
        batch.drop_column("key_provider")
    with op.batch_alter_table("snapshots") as batch:
        batch.drop_column("shred")
    with op.batch_alter_table("sandboxes") as batch:
        batch.drop_column("shred")
