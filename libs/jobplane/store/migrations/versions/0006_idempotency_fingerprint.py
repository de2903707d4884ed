"""idempotency fingerprint

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

WHERE = sa.text("idempotency_fingerprint IS NOT NULL")


def upgrade() -> None:
    # The fingerprint of the request that used an Idempotency-Key: a replay with another
    # request under the same key is refused instead of answered with the first instance.
    op.add_column(
        "job_instances", sa.Column("idempotency_fingerprint", sa.String(length=64), nullable=True)
    )
    # One key, one request, whatever the job. Only rows with a fingerprint are covered, so
    # instances created before this revision (a key reused across jobs was allowed) cannot
    # make the upgrade fail; (job_key, idempotency_key) stays unique for them as before.
    op.create_index(
        "uq_job_instances_idempotency_key",
        "job_instances",
        ["idempotency_key"],
        unique=True,
        postgresql_where=WHERE,
        sqlite_where=WHERE,
    )


def downgrade() -> None:
    op.drop_index("uq_job_instances_idempotency_key", table_name="job_instances")
    with op.batch_alter_table("job_instances") as batch:
        batch.drop_column("idempotency_fingerprint")
