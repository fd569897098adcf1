"""The Host a sandbox's servers see on port traffic (sandboxes.port_host; NULL: localhost:<port>),
E2B's maskRequestHost

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        batch.add_column(sa.Column("port_host", sa.String(255), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        batch.drop_column("port_host")
