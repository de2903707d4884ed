"""the app that registered a job

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # The name of the App whose worker registered the job, so the dashboard and the API can
    # show one app's jobs. Existing jobs get it at their worker's next start.
    op.add_column("job_definitions", sa.Column("app", sa.String(200), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("job_definitions") as batch:
        batch.drop_column("app")
