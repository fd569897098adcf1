"""security boundary: tenant quotas and default egress, secrets, sandbox egress policy and bindings

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | None = None
depends_on: str | None = None


def _ts(name: str, nullable: bool = False) -> sa.Column[sa.DateTime]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "tenant_quotas",
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("sandboxes", sa.Integer(), nullable=True),
        sa.Column("cpu", sa.Float(), nullable=True),
        sa.Column("memory_mb", sa.Integer(), nullable=True),
        sa.Column("storage_mb", sa.Integer(), nullable=True),
        sa.Column("egress", sa.JSON(), nullable=False),
        _ts("updated_at"),
        sa.PrimaryKeyConstraint("tenant", name=op.f("pk_tenant_quotas")),
    )
    op.create_table(
        "secrets",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("scope", sa.String(200), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("backend", sa.String(32), nullable=False),
        sa.Column("ciphertext", sa.LargeBinary(), nullable=True),
        sa.Column("ref", sa.String(512), nullable=True),
        sa.Column("key_id", sa.String(64), nullable=True),
        sa.Column("hosts", sa.JSON(), nullable=False),
        sa.Column("header", sa.String(128), nullable=False),
        sa.Column("format", sa.String(256), nullable=False),
        _ts("expires_at", nullable=True),
        sa.Column("rate_limit", sa.Integer(), nullable=True),
        sa.Column("created_by", sa.String(64), nullable=False),
        _ts("created_at"),
        _ts("updated_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_secrets")),
        sa.UniqueConstraint("tenant", "scope", "name", name=op.f("uq_secrets_tenant_scope_name")),
    )
    op.create_index(op.f("ix_secrets_tenant"), "secrets", ["tenant"])
    with op.batch_alter_table("sandboxes") as batch:
        batch.add_column(sa.Column("project", sa.String(128), nullable=False, server_default=""))
        batch.add_column(sa.Column("egress", sa.JSON(), nullable=False, server_default=sa.text("'{}'")))
        batch.add_column(sa.Column("secrets", sa.JSON(), nullable=False, server_default=sa.text("'[]'")))
    # Existing rows got their values; new ones get the model's defaults, as for every other column.
    with op.batch_alter_table("sandboxes") as batch:
        for column, kind in (("project", sa.String(128)), ("egress", sa.JSON()), ("secrets", sa.JSON())):
            batch.alter_column(column, existing_type=kind, server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        batch.drop_column("secrets")
        batch.drop_column("egress")
        batch.drop_column("project")
    op.drop_index(op.f("ix_secrets_tenant"), table_name="secrets")
    op.drop_table("secrets")
    op.drop_table("tenant_quotas")
