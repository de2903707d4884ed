"""instance counts by job and state, kept by triggers

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

#: Postgres: statement-level triggers read the rows a statement inserted, moved or deleted
#: (transition tables) and add one grouped delta per (job, state) to the counter rows of the
#: connection's shard. A counter row is locked from the change until commit: with one row per
#: (job, state) every worker claiming or finishing the same job would queue on it, so each
#: backend writes its own shard (pid modulo 16) and readers sum the shards. Rows are locked in
#: (job, state) order within a statement. ``UPDATE OF state`` cannot take transition tables,
#: so the update trigger sees every update and keeps the rows whose state differs.
POSTGRES_UP = [
    """
    CREATE FUNCTION jobplane_count_instances() RETURNS trigger
    LANGUAGE plpgsql AS $$
    DECLARE
        my_shard smallint := pg_backend_pid() % 16;
    BEGIN
        IF TG_OP = 'INSERT' THEN
            INSERT INTO instance_counts AS c (job_key, state, shard, n)
            SELECT job_key, state, my_shard, count(*) FROM new_rows
            GROUP BY job_key, state ORDER BY job_key, state
            ON CONFLICT (job_key, state, shard) DO UPDATE SET n = c.n + excluded.n;
        ELSIF TG_OP = 'DELETE' THEN
            INSERT INTO instance_counts AS c (job_key, state, shard, n)
            SELECT job_key, state, my_shard, -count(*) FROM old_rows
            GROUP BY job_key, state ORDER BY job_key, state
            ON CONFLICT (job_key, state, shard) DO UPDATE SET n = c.n + excluded.n;
        ELSE
            INSERT INTO instance_counts AS c (job_key, state, shard, n)
            SELECT job_key, state, my_shard, sum(delta) FROM (
                SELECT o.job_key, v.state, v.delta
                FROM old_rows o JOIN new_rows m ON m.id = o.id
                CROSS JOIN LATERAL (VALUES (o.state, -1), (m.state, 1)) AS v (state, delta)
                WHERE m.state <> o.state
            ) moved
            GROUP BY job_key, state HAVING sum(delta) <> 0 ORDER BY job_key, state
            ON CONFLICT (job_key, state, shard) DO UPDATE SET n = c.n + excluded.n;
        END IF;
        RETURN NULL;
    END
    $$
    """,
    """
    CREATE TRIGGER instance_counts_insert AFTER INSERT ON job_instances
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION jobplane_count_instances()
    """,
    """
    CREATE TRIGGER instance_counts_update AFTER UPDATE ON job_instances
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION jobplane_count_instances()
    """,
    """
    CREATE TRIGGER instance_counts_delete AFTER DELETE ON job_instances
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION jobplane_count_instances()
    """,
    # Writers wait (readers do not) while the existing rows are counted, so no change falls
    # between the triggers' start and the count.
    "LOCK TABLE job_instances IN SHARE ROW EXCLUSIVE MODE",
]

POSTGRES_DOWN = [
    "DROP TRIGGER instance_counts_delete ON job_instances",
    "DROP TRIGGER instance_counts_update ON job_instances",
    "DROP TRIGGER instance_counts_insert ON job_instances",
    "DROP FUNCTION jobplane_count_instances()",
]

#: SQLite (the embedded default; writes are serialised, so one shard): row-level triggers.
SQLITE_UP = [
    """
    CREATE TRIGGER instance_counts_insert AFTER INSERT ON job_instances
    BEGIN
        INSERT INTO instance_counts (job_key, state, shard, n)
        VALUES (NEW.job_key, NEW.state, 0, 1)
        ON CONFLICT (job_key, state, shard) DO UPDATE SET n = n + 1;
    END
    """,
    """
    CREATE TRIGGER instance_counts_update AFTER UPDATE OF state ON job_instances
    WHEN NEW.state <> OLD.state
    BEGIN
        INSERT INTO instance_counts (job_key, state, shard, n)
        VALUES (OLD.job_key, OLD.state, 0, -1)
        ON CONFLICT (job_key, state, shard) DO UPDATE SET n = n - 1;
        INSERT INTO instance_counts (job_key, state, shard, n)
        VALUES (NEW.job_key, NEW.state, 0, 1)
        ON CONFLICT (job_key, state, shard) DO UPDATE SET n = n + 1;
    END
    """,
    """
    CREATE TRIGGER instance_counts_delete AFTER DELETE ON job_instances
    BEGIN
        INSERT INTO instance_counts (job_key, state, shard, n)
        VALUES (OLD.job_key, OLD.state, 0, -1)
        ON CONFLICT (job_key, state, shard) DO UPDATE SET n = n - 1;
    END
    """,
]

SQLITE_DOWN = [
    "DROP TRIGGER instance_counts_delete",
    "DROP TRIGGER instance_counts_update",
    "DROP TRIGGER instance_counts_insert",
]

BACKFILL = """
INSERT INTO instance_counts (job_key, state, shard, n)
SELECT job_key, state, 0, count(*) FROM job_instances GROUP BY job_key, state
"""


def upgrade() -> None:
    # How many instances each job has in each state, changed in the same transaction as every
    # instance insert, state change and delete, so that no page counts a million rows.
    op.create_table(
        "instance_counts",
        sa.Column("job_key", sa.String(200), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("shard", sa.SmallInteger(), nullable=False),
        sa.Column("n", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("job_key", "state", "shard", name="pk_instance_counts"),
    )
    postgres = op.get_bind().dialect.name == "postgresql"
    for statement in POSTGRES_UP if postgres else SQLITE_UP:
        op.execute(statement)
    op.execute(BACKFILL)


def downgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    for statement in POSTGRES_DOWN if postgres else SQLITE_DOWN:
        op.execute(statement)
    op.drop_table("instance_counts")
