"""Template tags (template_tags): a name for one build of a template, ``name:tag``

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "template_tags",
        sa.Column("template", sa.String(128), nullable=False),
        sa.Column("tag", sa.String(128), nullable=False),
        sa.Column("digest", sa.String(128), nullable=False),
        sa.Column("build_id", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("template", "tag", name="pk_template_tags"),
    )


def downgrade() -> None:
    op.drop_table("template_tags")
