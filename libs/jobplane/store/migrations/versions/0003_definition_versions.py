"""definition versions

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

# Frozen copy of the kinds of change at this revision (migrations never import app code).
ACTIONS = ", ".join(f"'{a}'" for a in ("register", "edit", "pause", "resume", "rollback", "import"))


def upgrade() -> None:
    op.create_table(
        "job_definition_versions",
        sa.Column("job_key", sa.String(length=200), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column(
            "options",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column("paused", sa.Boolean(), nullable=False),
        sa.Column("action", sa.String(length=16), nullable=False),
        sa.Column("actor", sa.String(length=200), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("rolled_back_to", sa.Integer(), nullable=True),
        sa.CheckConstraint(
            f"action IN ({ACTIONS})", name=op.f("ck_job_definition_versions_action_valid")
        ),
        sa.ForeignKeyConstraint(
            ["job_key"],
            ["job_definitions.key"],
            name=op.f("fk_job_definition_versions_job_key_job_definitions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("job_key", "version", name=op.f("pk_job_definition_versions")),
    )
    # Definitions saved before this revision: their current version is where history starts.
    op.execute(
        "INSERT INTO job_definition_versions (job_key, version, options, paused, action, actor, at)"
        " SELECT key, version, options, paused, 'import', COALESCE(updated_by, 'unknown'),"
        " updated_at FROM job_definitions"
    )


def downgrade() -> None:
    op.drop_table("job_definition_versions")
