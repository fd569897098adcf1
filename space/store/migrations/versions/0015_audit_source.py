"""audit_log.source: a shipped audit record is stored once

``<node>:<journal>:<seq>`` of a gateway's record, unique: a drain retried after a crash between
storing and acknowledging, or two controllers draining at once, stores nothing twice.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("audit_log") as batch:
        batch.add_column(sa.Column("source", sa.String(200), nullable=True))
        batch.create_unique_constraint("uq_audit_log_source", ["source"])


def downgrade() -> None:
    with op.batch_alter_table("audit_log") as batch:
        batch.drop_constraint("uq_audit_log_source", type_="unique")
        batch.drop_column("source")
