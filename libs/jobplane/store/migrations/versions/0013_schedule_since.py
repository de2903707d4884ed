"""schedule since

Revision ID: 0013
Revises: 0007
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # When the job's schedule (cron, time zone, start) last changed: occurrences of a new
    # schedule before it never existed, so the leader's catch-up never starts earlier.
    op.add_column(
        "job_definitions", sa.Column("schedule_since", sa.DateTime(timezone=True), nullable=True)
    )


def downgrade() -> None:
    with op.batch_alter_table("job_definitions") as batch:
        batch.drop_column("schedule_since")
