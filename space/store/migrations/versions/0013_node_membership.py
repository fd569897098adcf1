"""node membership: join tokens, and the node certificate each node joined with

``join_tokens`` admits nodes (the secret half stored as its sha256); ``nodes`` gains the certificate
the cluster CA issued, the public key only whose holder may join again under that id, and the
agent's version.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "join_tokens",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("secret_hash", sa.String(64), nullable=False),
        sa.Column("description", sa.String(256), nullable=False),
        sa.Column("created_by", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("uses", sa.Integer(), nullable=False),
        sa.Column("max_uses", sa.Integer(), nullable=True),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
    )
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("certificate", sa.Text(), nullable=True))
        batch.add_column(sa.Column("key_sha256", sa.String(64), nullable=True))
        batch.add_column(sa.Column("version", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("version")
        batch.drop_column("key_sha256")
        batch.drop_column("certificate")
    op.drop_table("join_tokens")
