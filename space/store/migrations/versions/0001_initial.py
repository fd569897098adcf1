"""initial schema: api keys, nodes, templates, sandboxes, operations and their logs

Revision ID: 0001
Revises:
Create Date: 2025-11-29
"""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None


def _ts(name: str, nullable: bool = False) -> sa.Column[dt.datetime]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("name", sa.String(256), nullable=False),
        sa.Column("prefix", sa.String(8), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False),
        _ts("created_at"),
        _ts("revoked_at", nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
    )
    op.create_index(op.f("ix_api_keys_tenant"), "api_keys", ["tenant"])

    op.create_table(
        "nodes",
        sa.Column("id", sa.String(128), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("token", sa.Text(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("capacity", sa.JSON(), nullable=False),
        _ts("heartbeat_at"),
        _ts("created_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_nodes")),
    )

    op.create_table(
        "templates",
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("digest", sa.String(128), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        _ts("created_at"),
        _ts("updated_at"),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_templates")),
    )

    op.create_table(
        "sandboxes",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("template", sa.String(128), nullable=False),
        sa.Column("template_digest", sa.String(128), nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("node_id", sa.String(128), nullable=True),
        sa.Column("instance_id", sa.String(64), nullable=True),
        sa.Column("cpu", sa.Float(), nullable=False),
        sa.Column("memory_mb", sa.Integer(), nullable=False),
        sa.Column("env", sa.JSON(), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.Column("error_code", sa.String(64), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        _ts("created_at"),
        _ts("updated_at"),
        _ts("terminated_at", nullable=True),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sandboxes")),
    )
    op.create_index(op.f("ix_sandboxes_tenant"), "sandboxes", ["tenant"])

    op.create_table(
        "operations",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("target", sa.String(128), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("idempotency_key", sa.String(256), nullable=True),
        sa.Column("request", sa.JSON(), nullable=False),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("error_code", sa.String(64), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("progress", sa.JSON(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("lease_owner", sa.String(128), nullable=True),
        _ts("lease_expires_at", nullable=True),
        _ts("created_at"),
        _ts("updated_at"),
        _ts("finished_at", nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_operations")),
        sa.UniqueConstraint(
            "tenant", "idempotency_key", name=op.f("uq_operations_tenant_idempotency_key")
        ),
    )
    op.create_index(op.f("ix_operations_tenant"), "operations", ["tenant"])
    op.create_index(op.f("ix_operations_target"), "operations", ["target"])
    op.create_index("ix_operations_status_created_at", "operations", ["status", "created_at"])

    op.create_table(
        "operation_logs",
        sa.Column("op_id", sa.String(64), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("line", sa.Text(), nullable=False),
        _ts("at"),
        sa.ForeignKeyConstraint(
            ["op_id"],
            ["operations.id"],
            name=op.f("fk_operation_logs_op_id_operations"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("op_id", "seq", name=op.f("pk_operation_logs")),
    )


def downgrade() -> None:
    op.drop_table("operation_logs")
    op.drop_index("ix_operations_status_created_at", table_name="operations")
    op.drop_index(op.f("ix_operations_target"), table_name="operations")
    op.drop_index(op.f("ix_operations_tenant"), table_name="operations")
    op.drop_table("operations")
    op.drop_index(op.f("ix_sandboxes_tenant"), table_name="sandboxes")
    op.drop_table("sandboxes")
    op.drop_table("templates")
    op.drop_table("nodes")
    op.drop_index(op.f("ix_api_keys_tenant"), table_name="api_keys")
    op.drop_table("api_keys")
