"""A large, realistic ``job_instances`` table for the listing benchmark, filled in SQL.

One ``INSERT … SELECT generate_series`` writes every row (no transitions: listings do not read
them). The spread follows a long-running deployment:

* ``jobs`` job keys with a skewed share (the busiest about a fifth of all rows, the quietest
  about 1 %); the first quarter of the keys are cron jobs.
* ``created_at`` evenly over ``days`` ending now, in insertion order; the id is a UUIDv7 made
  from that time (as the store makes them), so id order is time order.
* Old rows are ended (mostly Succeeded, some Skipped, Terminated, Cancelled, Failed); the newest
  0.5 % are still Scheduled, Enqueued or Processing.
* Workers are replaced on every deploy: ``deploys`` generations of ``workers_per_deploy``
  workers, each generation running one slice of the time span.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import BigInteger, DateTime, Integer, bindparam, text

from jobplane.domain.options import JobOptions
from jobplane.store.engine import AsyncEngine
from jobplane.store.sql import SqlStore


@dataclass(frozen=True, slots=True)
class Spread:
    instances: int
    jobs: int = 20
    days: int = 30
    deploys: int = 10
    workers_per_deploy: int = 4

    @property
    def job_keys(self) -> list[str]:
        return [f"bench-job-{i:02d}" for i in range(self.jobs)]

    @property
    def cron_jobs(self) -> int:
        return max(1, self.jobs // 4)

    def worker_ids(self, deploy: int) -> list[str]:
        return [f"worker-d{deploy:02d}-{k}" for k in range(self.workers_per_deploy)]


# The random draws of a row are taken once (inner query) so that the state, the worker and the
# times agree with one another. setseed() makes the table the same on every run.
FILL_SQL = """
INSERT INTO job_instances (
    id, job_key, state, source, queue, priority, args, created_at, scheduled_at, run_at,
    published_at, started_at, finished_at, attempt, claim_token, worker_id, result, error
)
SELECT
    (lpad(to_hex((extract(epoch FROM created_at) * 1000)::bigint), 12, '0')
        || '7' || substr(h, 1, 3) || '8' || substr(h, 4, 15))::uuid,
    job_key, state, source, 'default', 5, jsonb_build_object('n', g), created_at,
    CASE WHEN source = 'cron' THEN created_at - interval '5 milliseconds' END,
    CASE WHEN state = 'scheduled' THEN created_at + interval '1 hour' END,
    CASE WHEN state NOT IN ('scheduled', 'skipped') THEN created_at END,
    CASE WHEN started THEN created_at + interval '40 milliseconds' END,
    CASE WHEN state IN ('succeeded', 'terminated', 'cancelled', 'skipped', 'failed')
        THEN created_at + (40 + r_time * 5000) * interval '1 millisecond' END,
    CASE WHEN started THEN 1 ELSE 0 END,
    CASE WHEN started THEN g END,
    CASE WHEN started
        THEN format('worker-d%s-%s', lpad(deploy::text, 2, '0'), floor(r_worker * :per_deploy))
    END,
    CASE WHEN state = 'succeeded' THEN '{"ok": true}'::jsonb END,
    CASE WHEN state IN ('failed', 'terminated')
        THEN '{"type": "TimeoutError", "message": "upstream did not answer"}'::jsonb END
FROM (
    SELECT
        g, h, r_time, r_worker, created_at, job_key, source, state,
        least(floor((g - 1) * :deploys / :n), :deploys - 1)::int AS deploy,
        state IN ('processing', 'succeeded', 'failed', 'terminated') AS started
    FROM (
        SELECT
            g, h, r_time, r_worker, created_at,
            format('bench-job-%s', lpad(job::text, 2, '0')) AS job_key,
            CASE WHEN job < :cron_jobs THEN 'cron' ELSE 'trigger' END AS source,
            CASE
                WHEN g > :n * 0.995 THEN CASE
                    WHEN r_state < 0.3 THEN 'enqueued'
                    WHEN r_state < 0.5 THEN 'processing'
                    WHEN r_state < 0.7 THEN 'scheduled'
                    ELSE 'succeeded' END
                WHEN r_state < 0.90 THEN 'succeeded'
                WHEN r_state < 0.94 THEN 'skipped'
                WHEN r_state < 0.97 THEN 'terminated'
                WHEN r_state < 0.99 THEN 'cancelled'
                ELSE 'failed'
            END AS state
        FROM (
            SELECT
                g,
                md5(g::text) AS h,
                floor(:jobs * random() ^ 2)::int AS job,
                random() AS r_state,
                random() AS r_worker,
                random() AS r_time,
                :start + (g - 1) * :step * interval '1 millisecond'
                    + floor(random() * :step / 2) * interval '1 millisecond' AS created_at
            FROM generate_series(1, :n) AS g
        ) AS draws
    ) AS rows
) AS spread
"""
INT_PARAMS = ("jobs", "cron_jobs", "deploys", "per_deploy")


async def register_jobs(store: SqlStore, spread: Spread) -> None:
    for i, key in enumerate(spread.job_keys):
        # Two apps: the recurring jobs' and the triggered jobs' (the dashboard's app scope).
        if i < spread.cron_jobs:
            options = JobOptions.parse(key=key, kind="recurring", cron="* * * * *")
            app = "bench-cron"
        else:
            options = JobOptions.parse(key=key, kind="triggered")
            app = "bench"
        await store.register_definition(options, None, "bench", app=app)


async def fill(engine: AsyncEngine, spread: Spread) -> tuple[datetime, datetime]:
    """Insert ``spread.instances`` rows and ANALYZE; return the span of ``created_at``."""
    end = datetime.now().astimezone()
    start = end - timedelta(days=spread.days)
    step_ms = spread.days * 86_400_000 // spread.instances
    async with engine.begin() as conn:
        await conn.execute(text("SELECT setseed(0.42)"))
        await conn.execute(
            text(FILL_SQL).bindparams(
                bindparam("n", type_=BigInteger),
                bindparam("step", type_=BigInteger),
                bindparam("start", type_=DateTime(timezone=True)),
                *(bindparam(p, type_=Integer) for p in INT_PARAMS),
            ),
            {
                "n": spread.instances,
                "jobs": spread.jobs,
                "cron_jobs": spread.cron_jobs,
                "deploys": spread.deploys,
                "per_deploy": spread.workers_per_deploy,
                "start": start,
                "step": step_ms,
            },
        )
    async with engine.connect() as conn:
        await conn.execution_options(isolation_level="AUTOCOMMIT")
        await conn.execute(text("VACUUM ANALYZE job_instances"))
    return start, start + timedelta(milliseconds=step_ms * spread.instances)


async def clear(engine: AsyncEngine) -> None:
    """Empty the bench database's instance tables (the triggers of the first part)."""
    async with engine.begin() as conn:
        await conn.execute(text("TRUNCATE job_instances, instance_transitions"))
