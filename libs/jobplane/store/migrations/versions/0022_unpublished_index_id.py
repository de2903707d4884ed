"""the unpublished index orders by id after the publication time

Revision ID: 0022
Revises: 0021
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None

NAME = "ix_job_instances_unpublished"
BUILDING = "ix_job_instances_unpublished_new"
WHERE = sa.text("state = 'enqueued'")


def upgrade() -> None:
    # The leader's republish sweep walks the Enqueued instances a page at a time in
    # (publication time, id) order, from where the last page ended. A batch is published at
    # one time, so the id decides among thousands of ties; in the index, each page starts where
    # it should and needs no sort (without it, every page sorted a job's whole backlog). The
    # previous release's query reads the first two columns as before. The new index is built
    # beside the old one (writes to the table wait meanwhile, reads do not: docs/deploy.md),
    # then takes its name.
    op.create_index(
        BUILDING,
        "job_instances",
        ["job_key", "published_at", "id"],
        postgresql_where=WHERE,
        sqlite_where=WHERE,
    )
    op.drop_index(NAME, table_name="job_instances", postgresql_where=WHERE, sqlite_where=WHERE)
    _rename(BUILDING, NAME, ["job_key", "published_at", "id"])


def downgrade() -> None:
    op.create_index(
        BUILDING,
        "job_instances",
        ["job_key", "published_at"],
        postgresql_where=WHERE,
        sqlite_where=WHERE,
    )
    op.drop_index(NAME, table_name="job_instances", postgresql_where=WHERE, sqlite_where=WHERE)
    _rename(BUILDING, NAME, ["job_key", "published_at"])


def _rename(old: str, new: str, columns: list[str]) -> None:
    """Postgres renames the index in place; SQLite cannot, so it builds it again under the
    name (its tables are small: the embedded default)."""
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"ALTER INDEX {old} RENAME TO {new}")
        return
    op.create_index(new, "job_instances", columns, sqlite_where=WHERE)
    op.drop_index(old, table_name="job_instances", sqlite_where=WHERE)
