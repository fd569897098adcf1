"""stateful lifecycle: snapshots, sandbox events, idle/expiry/fork/suspend columns on sandboxes

Revision ID: 0002
Revises: 0001
Create Date: 2025-12-06
"""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None

_NULLABLE_SANDBOX_COLUMNS = (
    ("idle_pause_s", sa.Integer()),
    ("idle_suspend_s", sa.Integer()),
    ("expires_at", sa.DateTime(timezone=True)),
    ("last_active_at", sa.DateTime(timezone=True)),
    ("parent_id", sa.String(64)),
    ("source_snapshot", sa.String(64)),
    ("snapshot_id", sa.String(64)),
)


def _ts(name: str, nullable: bool = False) -> sa.Column[dt.datetime]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    # Plain ADD COLUMNs (native on SQLite too). snapshot_policy is NOT NULL, so existing rows get
    # '{}' through a server default, which is dropped again: the application always writes it.
    with op.batch_alter_table("sandboxes") as batch:
        for name, type_ in _NULLABLE_SANDBOX_COLUMNS:
            batch.add_column(sa.Column(name, type_, nullable=True))
        batch.add_column(
            sa.Column("snapshot_policy", sa.JSON(), nullable=False, server_default=sa.text("'{}'"))
        )
    # A separate batch: on SQLite this one copies the table, which must already hold the column.
    with op.batch_alter_table("sandboxes") as batch:
        batch.alter_column("snapshot_policy", existing_type=sa.JSON(), server_default=None)

    op.create_table(
        "snapshots",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("sandbox_id", sa.String(64), nullable=False),
        sa.Column("kind", sa.String(8), nullable=False),
        sa.Column("origin", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("node_id", sa.String(128), nullable=True),
        sa.Column("object_key", sa.String(512), nullable=True),
        sa.Column("restorable", sa.Boolean(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=True),
        sa.Column("template", sa.String(128), nullable=False),
        sa.Column("template_digest", sa.String(128), nullable=True),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        _ts("created_at"),
        _ts("updated_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_snapshots")),
    )
    op.create_index(op.f("ix_snapshots_tenant"), "snapshots", ["tenant"])
    op.create_index(
        "ix_snapshots_sandbox_id_created_at", "snapshots", ["sandbox_id", "created_at"]
    )

    op.create_table(
        "sandbox_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("sandbox_id", sa.String(64), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        _ts("at"),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sandbox_events")),
        sqlite_autoincrement=True,
    )
    op.create_index(op.f("ix_sandbox_events_sandbox_id"), "sandbox_events", ["sandbox_id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_sandbox_events_sandbox_id"), table_name="sandbox_events")
    op.drop_table("sandbox_events")
    op.drop_index("ix_snapshots_sandbox_id_created_at", table_name="snapshots")
    op.drop_index(op.f("ix_snapshots_tenant"), table_name="snapshots")
    op.drop_table("snapshots")
    with op.batch_alter_table("sandboxes") as batch:
        batch.drop_column("snapshot_policy")
        for name, _ in reversed(_NULLABLE_SANDBOX_COLUMNS):
            batch.drop_column(name)
