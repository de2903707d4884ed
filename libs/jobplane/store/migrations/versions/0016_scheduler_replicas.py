"""scheduler replicas

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Each scheduler replica's last campaign, so the standbys can be listed beside the leader.
    op.create_table(
        "scheduler_replicas",
        sa.Column("shard", sa.Integer(), nullable=False),
        sa.Column("holder", sa.String(200), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("shard", "holder"),
    )


def downgrade() -> None:
    op.drop_table("scheduler_replicas")
