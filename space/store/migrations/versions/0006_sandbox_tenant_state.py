"""an index on sandboxes (tenant, state): quota usage counts a tenant's live sandboxes

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-29
"""

from __future__ import annotations

from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_index("ix_sandboxes_tenant_state", "sandboxes", ["tenant", "state"])


def downgrade() -> None:
    op.drop_index("ix_sandboxes_tenant_state", table_name="sandboxes")
