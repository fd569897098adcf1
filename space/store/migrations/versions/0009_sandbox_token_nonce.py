"""a sandbox's token nonce: what its E2B access tokens are made with (rotated on demand and on delete)

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

from __future__ import annotations

import secrets

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        batch.add_column(sa.Column("token_nonce", sa.String(64), nullable=True))
    # Every existing row gets a nonce of its own: the tokens handed out before (derived from the id
    # alone, never rotated) stop working; a client gets the new ones from connect.
    conn = op.get_bind()
    sandboxes = sa.table("sandboxes", sa.column("id", sa.String), sa.column("token_nonce", sa.String))
    for (sandbox_id,) in conn.execute(sa.select(sandboxes.c.id)).fetchall():
        conn.execute(sandboxes.update().where(sandboxes.c.id == sandbox_id)
                     .values(token_nonce=secrets.token_urlsafe(16)))


def downgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        batch.drop_column("token_nonce")
