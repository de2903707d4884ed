"""runaway slots

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A concurrency slot still held by an attempt whose outcome is recorded (Failed on timeout)
    # while its sync code runs on: released by the worker once the thread returns, or by the
    # dead-worker sweep if that worker goes away first.
    op.create_table(
        "runaway_slots",
        sa.Column("instance_id", sa.Uuid(), nullable=False),
        sa.Column("claim_token", sa.BigInteger(), nullable=False),
        sa.Column("job_key", sa.String(length=200), nullable=False),
        sa.Column("worker_id", sa.String(length=200), nullable=False),
        sa.Column("held_since", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_key"],
            ["job_definitions.key"],
            name="fk_runaway_slots_job_key_job_definitions",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("instance_id", "claim_token", name="pk_runaway_slots"),
    )
    op.create_index("ix_runaway_slots_worker_id", "runaway_slots", ["worker_id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_runaway_slots_worker_id", table_name="runaway_slots")
    op.drop_table("runaway_slots")
