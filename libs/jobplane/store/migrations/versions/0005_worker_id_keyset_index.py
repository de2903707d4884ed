"""worker keyset index

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

WHERE = sa.text("worker_id IS NOT NULL")


def upgrade() -> None:
    # Listing a worker's instances newest first: (worker_id, id) reads them in keyset order.
    # The index on worker_id alone made the planner walk the primary key back from the newest
    # row, ~180 ms for a worker of an earlier deploy among a million instances.
    op.create_index(
        "ix_job_instances_worker_id_id",
        "job_instances",
        ["worker_id", "id"],
        unique=False,
        postgresql_where=WHERE,
    )
    op.drop_index("ix_job_instances_worker_id", table_name="job_instances")


def downgrade() -> None:
    op.create_index(
        "ix_job_instances_worker_id",
        "job_instances",
        ["worker_id"],
        unique=False,
        postgresql_where=WHERE,
    )
    op.drop_index("ix_job_instances_worker_id_id", table_name="job_instances")
