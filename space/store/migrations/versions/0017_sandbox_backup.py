"""sandboxes.backup: what of the sandbox is durable in object storage (its disk backup chain);
node state ``down`` is now ``unreachable`` (and ``lost`` follows it)

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        batch.add_column(sa.Column("backup", sa.JSON(), nullable=True))
    op.execute("UPDATE nodes SET state = 'unreachable' WHERE state = 'down'")


def downgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        batch.drop_column("backup")
    op.execute("UPDATE nodes SET state = 'down' WHERE state IN ('unreachable', 'lost')")
