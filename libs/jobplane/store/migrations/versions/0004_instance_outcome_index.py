"""instance outcome index

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # The latest outcome of each job and its last-24-hours counts, read by the jobs list.
    # Only ended instances have ``finished_at``, so the index skips the queue.
    op.create_index(
        "ix_job_instances_job_key_finished_at",
        "job_instances",
        ["job_key", "finished_at"],
        unique=False,
        postgresql_where=sa.text("finished_at IS NOT NULL"),
        sqlite_where=sa.text("finished_at IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index(
        "ix_job_instances_job_key_finished_at",
        table_name="job_instances",
        postgresql_where=sa.text("finished_at IS NOT NULL"),
        sqlite_where=sa.text("finished_at IS NOT NULL"),
    )
