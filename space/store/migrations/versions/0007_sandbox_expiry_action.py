"""what a sandbox's timeout does (delete or pause), whether data-plane traffic wakes it, and
whether its ports take requests without a token (E2B's public traffic)

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        batch.add_column(sa.Column("expire_action", sa.String(16), nullable=False, server_default="delete"))
        batch.add_column(sa.Column("auto_resume", sa.Boolean(), nullable=False, server_default=sa.true()))
        batch.add_column(sa.Column("public_ports", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        batch.drop_column("public_ports")
        batch.drop_column("auto_resume")
        batch.drop_column("expire_action")
