"""a transaction may name the shard of the instance counts it writes

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-07
"""

from __future__ import annotations

from alembic import op

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None

#: The counting triggers of 0017, with the shard chosen as before (the backend's pid modulo
#: 16) unless the transaction sets ``jobplane.count_shard``. The leader writes each cron tick
#: ahead of its time in a transaction it holds open until the tick (up to a quarter of a
#: second), which keeps the counter rows it wrote locked until then: on its session's shard, a
#: claim of one of those jobs' instances (which moves the job's Enqueued count down on its own
#: session's shard) waited for the tick, holding the job's concurrency slot meanwhile. The held
#: transaction now writes a shard no session's pid gives (16), so no claim meets its rows.
#: Readers sum every shard, so the counts are unchanged. (``current_setting`` is read once per
#: statement; after a ``SET LOCAL`` the setting reads '' in later transactions, hence the
#: ``nullif``.)
SHARD = "coalesce(nullif(current_setting('jobplane.count_shard', true), '')::smallint, {default})"


def _function(shard: str) -> str:
    return f"""
    CREATE OR REPLACE FUNCTION jobplane_count_instances() RETURNS trigger
    LANGUAGE plpgsql AS $$
    DECLARE
        my_shard smallint := {shard};
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
    """


def upgrade() -> None:
    # (SQLite serialises its writes: one shard, row-level triggers, nothing to change.)
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(_function(SHARD.format(default="pg_backend_pid() % 16")))


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(_function("pg_backend_pid() % 16"))
