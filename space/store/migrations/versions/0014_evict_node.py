"""sandboxes.evict_node: the suspend → evict hand-off, durable

A suspended sandbox's row names the node that still holds its old copy until that copy's removal
is confirmed, so that a restore claimed by any controller (the one that suspended it may have
crashed) removes it first.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        batch.add_column(sa.Column("evict_node", sa.String(128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        batch.drop_column("evict_node")
