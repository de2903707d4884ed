"""Postgres: the statistics of :mod:`jobplane.store.stats` as single statements, aggregated in
the database (``percentile_cont``, ``count(*) FILTER``)."""

from __future__ import annotations

from collections.abc import Collection
from datetime import timedelta

from sqlalchemy import text

from jobplane.domain.models import Bucket, JobSummary, Lags
from jobplane.domain.states import InstanceState
from jobplane.ids import ID_CLOCK_SKEW, id_floor
from jobplane.store.stats import DAY_S, HOUR_S, TERMINAL, StatsStore

_TERMINAL = ", ".join(f"'{s}'" for s in TERMINAL)

# Every job's latest outcome, recent counts and p95 attempt duration in one statement. The
# latest outcome and the counts read ix_job_instances_job_key_finished_at once per job (a
# LATERAL join, not a scan of all instances); the durations read the window of history by its
# ``at`` index and pair each attempt's claim with its end by the claim token.
SUMMARIES_SQL = f"""
WITH durations AS (
    SELECT i.job_key,
           percentile_cont(0.95) WITHIN GROUP (ORDER BY EXTRACT(EPOCH FROM e.at - s.at)) AS p95
    FROM instance_transitions e
    JOIN instance_transitions s
      ON s.instance_id = e.instance_id AND s.claim_token = e.claim_token
     AND s.to_state = 'processing'
    JOIN job_instances i ON i.id = e.instance_id
    WHERE e.from_state = 'processing' AND e.at >= :since
      AND (CAST(:keys AS text[]) IS NULL OR i.job_key = ANY(CAST(:keys AS text[])))
    GROUP BY i.job_key
)
SELECT d.key, last.state AS last_state, last.finished_at AS last_ended_at,
       recent.succeeded, recent.ended, durations.p95
FROM job_definitions d
LEFT JOIN LATERAL (
    SELECT state, finished_at FROM job_instances
    WHERE job_key = d.key AND finished_at IS NOT NULL AND state IN ({_TERMINAL})
    ORDER BY finished_at DESC
    LIMIT 1
) last ON true
LEFT JOIN LATERAL (
    SELECT count(*) FILTER (WHERE state = 'succeeded') AS succeeded, count(*) AS ended
    FROM job_instances
    WHERE job_key = d.key AND finished_at IS NOT NULL
      AND finished_at >= :since AND state IN ({_TERMINAL})
) recent ON true
LEFT JOIN durations ON durations.job_key = d.key
WHERE CAST(:keys AS text[]) IS NULL OR d.key = ANY(CAST(:keys AS text[]))
"""

SUMMARIES = text(SUMMARIES_SQL)

# Ends per time bucket, bucketed by the database on the history's ``at`` (its index bounds the
# scan to the window); empty buckets come from the series, so every bucket is present.
THROUGHPUT_SQL = """
WITH bounds AS (
    SELECT make_interval(secs => :width) AS width,
           date_bin(make_interval(secs => :width), now(), TIMESTAMPTZ '2000-01-01 00:00+00')
               AS last
),
series AS (
    SELECT generate_series(last - width * (:count - 1), last, width) AS start FROM bounds
),
counts AS (
    SELECT date_bin((SELECT width FROM bounds), t.at, TIMESTAMPTZ '2000-01-01 00:00+00')
               AS start,
           count(*) FILTER (WHERE t.to_state = 'succeeded') AS succeeded,
           count(*) FILTER (WHERE t.to_state = 'failed') AS failed,
           count(*) FILTER (WHERE t.to_state = 'terminated') AS terminated
    FROM instance_transitions t
    WHERE t.at >= (SELECT min(start) FROM series)
      AND t.to_state IN ('succeeded', 'failed', 'terminated')
      AND (CAST(:jobs AS text[]) IS NULL OR EXISTS (
          SELECT 1 FROM job_instances i
          WHERE i.id = t.instance_id AND i.job_key = ANY(CAST(:jobs AS text[]))))
    GROUP BY 1
)
SELECT s.start, COALESCE(c.succeeded, 0) AS succeeded, COALESCE(c.failed, 0) AS failed,
       COALESCE(c.terminated, 0) AS terminated
FROM series s LEFT JOIN counts c ON c.start = s.start
ORDER BY s.start
"""

THROUGHPUT = text(THROUGHPUT_SQL)

# The Overview's lags, aggregated here. Fire lag: the cron ticks created in the window (a
# range of the time-ordered primary key); pickup lag: the claims recorded in the window (the
# history's ``at`` index), each paired with its instance's latest → Enqueued before it (one
# probe of the (instance_id, seq) index).
LAGS_SQL = """
WITH fires AS (
    SELECT percentile_cont(0.95) WITHIN GROUP (
               ORDER BY EXTRACT(EPOCH FROM created_at - scheduled_at)) AS p95,
           count(*) AS n
    FROM job_instances
    WHERE id >= :id_floor AND created_at >= :since AND source = 'cron'
      AND state <> 'skipped' AND scheduled_at IS NOT NULL
),
pickups AS (
    SELECT percentile_cont(0.95) WITHIN GROUP (ORDER BY EXTRACT(EPOCH FROM c.at - q.at)) AS p95,
           count(*) AS n
    FROM instance_transitions c
    CROSS JOIN LATERAL (
        SELECT at FROM instance_transitions q
        WHERE q.instance_id = c.instance_id AND q.seq < c.seq AND q.to_state = 'enqueued'
        ORDER BY q.seq DESC
        LIMIT 1
    ) q
    WHERE c.to_state = 'processing' AND c.at >= :since
)
SELECT fires.p95 AS fire_p95, fires.n AS fires, pickups.p95 AS pickup_p95, pickups.n AS pickups
FROM fires, pickups
"""

LAGS = text(LAGS_SQL)


class PostgresStatsStore(StatsStore):
    async def job_summaries(
        self, keys: Collection[str] | None = None, *, window_s: float = DAY_S
    ) -> dict[str, JobSummary]:
        async with self._read() as conn:
            # The window's start as a value, not an expression: the planner then estimates
            # how much history it covers (and joins accordingly).
            since = await self._now(conn) - timedelta(seconds=window_s)
            params = {"since": since, "keys": None if keys is None else list(keys)}
            result = await conn.execute(SUMMARIES, params)
            return {
                row.key: JobSummary(
                    key=row.key,
                    last_state=InstanceState(row.last_state) if row.last_state else None,
                    last_ended_at=row.last_ended_at,
                    succeeded=row.succeeded,
                    ended=row.ended,
                    p95_duration_s=float(row.p95) if row.p95 is not None else None,
                )
                for row in result
            }

    async def throughput(
        self,
        width_s: int,
        count: int,
        job_key: str | None = None,
        *,
        job_keys: Collection[str] | None = None,
    ) -> list[Bucket]:
        jobs = [job_key] if job_key is not None else None
        if job_keys is not None:
            jobs = [k for k in job_keys if jobs is None or k in jobs]
        params = {"width": width_s, "count": count, "jobs": jobs}
        async with self._read() as conn:
            result = await conn.execute(THROUGHPUT, params)
            return [
                Bucket(
                    start=row.start,
                    succeeded=row.succeeded,
                    failed=row.failed,
                    terminated=row.terminated,
                )
                for row in result
            ]

    async def lags(self, window_s: float = HOUR_S) -> Lags:
        async with self._read() as conn:
            since = await self._now(conn) - timedelta(seconds=window_s)
            params = {"since": since, "id_floor": id_floor(since - ID_CLOCK_SKEW)}
            row = (await conn.execute(LAGS, params)).one()
        return Lags(
            fire_p95_s=float(row.fire_p95) if row.fire_p95 is not None else None,
            fires=row.fires,
            pickup_p95_s=float(row.pickup_p95) if row.pickup_p95 is not None else None,
            pickups=row.pickups,
        )
