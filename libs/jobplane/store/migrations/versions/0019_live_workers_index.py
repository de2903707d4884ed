"""live workers index

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

NAME = "ix_workers_live"
WHERE = sa.text("stopped_at IS NULL")


def upgrade() -> None:
    # Every worker process registers its own row, which stays after it stops: counting the
    # live workers (each metrics scrape) read the whole table. The partial index holds only
    # the live ones, so the count costs what the live workers do.
    op.create_index(NAME, "workers", ["id"], postgresql_where=WHERE, sqlite_where=WHERE)


def downgrade() -> None:
    op.drop_index(NAME, table_name="workers", postgresql_where=WHERE, sqlite_where=WHERE)
