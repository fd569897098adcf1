"""snapshots that outlive their sandbox (retain) and carry a name

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("snapshots") as batch:
        batch.add_column(sa.Column("name", sa.String(128), nullable=True))
        batch.add_column(sa.Column("retain", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("snapshots") as batch:
        batch.drop_column("retain")
        batch.drop_column("name")
