"""Read-only statistics for the API: how each job has been doing, throughput over time.

The generic statements here serve SQLite (the embedded default); Postgres computes the same
answers in single statements (:mod:`jobplane.store.postgres_stats`).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import (
    Integer,
    Select,
    String,
    and_,
    case,
    cast,
    func,
    literal,
    select,
    union_all,
)

from jobplane.domain.models import Bucket, JobSummary, Lags
from jobplane.domain.states import TERMINAL_STATES, InstanceState
from jobplane.ids import ID_CLOCK_SKEW, id_floor
from jobplane.store.base import SqlBase
from jobplane.store.engine import AsyncConnection
from jobplane.store.tables import (
    instance_counts,
    instance_transitions,
    job_instances,
    workers,
)

TERMINAL = sorted(s.value for s in TERMINAL_STATES)

#: The ends that throughput counts (history records reaching these states).
ENDS = (InstanceState.SUCCEEDED.value, InstanceState.FAILED.value, InstanceState.TERMINATED.value)

transition_cols = instance_transitions.c

#: The window of the jobs list's recent figures.
DAY_S = 24 * 3600.0
#: The window of the Overview's lag figures.
HOUR_S = 3600.0


def percentile_cont(values: Sequence[float], fraction: float) -> float | None:
    """The percentile by linear interpolation between the closest ranks: what Postgres's
    ``percentile_cont`` returns. ``None`` for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


class StatsStore(SqlBase):
    """Job summaries and throughput (generic; Postgres overrides them)."""

    async def gauges(self) -> tuple[dict[tuple[str, InstanceState], int], int]:
        """Instances by (job, state) and the workers that have not stopped, in one
        statement (what a metrics scrape reads). The instances are the counters the triggers
        of migration 0017 keep (at most jobs x states x shards rows, however many instances
        there are), the workers the live ones (a partial index, however many have stopped)."""
        count_cols = instance_counts.c
        total = func.sum(count_cols.n)
        by_job = (
            select(count_cols.job_key, count_cols.state, total.label("n"))
            .group_by(count_cols.job_key, count_cols.state)
            .having(total != 0)  # a (job, state) whose instances all moved or went: absent
        )
        live = select(
            literal(None, String).label("job_key"),
            literal(None, String).label("state"),
            func.count().label("n"),
        ).where(workers.c.stopped_at.is_(None))
        counts: dict[tuple[str, InstanceState], int] = {}
        live_workers = 0
        async with self._read() as conn:
            for job_key, state, n in await conn.execute(union_all(by_job, live)):
                if job_key is None:
                    live_workers = int(n)
                else:
                    counts[(job_key, InstanceState(state))] = int(n)
        return counts, live_workers

    async def job_summaries(
        self, keys: Collection[str] | None = None, *, window_s: float = DAY_S
    ) -> dict[str, JobSummary]:
        async with self._read() as conn:
            since = await self._now(conn) - timedelta(seconds=window_s)
            # One grouped statement for every job's latest outcome and recent counts.
            ranked = (
                select(
                    job_instances.c.job_key,
                    job_instances.c.state,
                    job_instances.c.finished_at,
                    func.row_number()
                    .over(
                        partition_by=job_instances.c.job_key,
                        order_by=job_instances.c.finished_at.desc(),
                    )
                    .label("rn"),
                )
                .where(
                    job_instances.c.finished_at.is_not(None), job_instances.c.state.in_(TERMINAL)
                )
                .subquery()
            )
            r = ranked.c
            recent = r.finished_at >= since
            query = select(
                r.job_key,
                func.max(case((r.rn == 1, r.state))).label("last_state"),
                func.max(case((r.rn == 1, r.finished_at))).label("last_ended_at"),
                func.sum(
                    case((and_(recent, r.state == InstanceState.SUCCEEDED.value), 1), else_=0)
                ),
                func.sum(case((recent, 1), else_=0)),
            ).group_by(r.job_key)
            if keys is not None:
                query = query.where(r.job_key.in_(list(keys)))
            out = {
                key: JobSummary(
                    key=key,
                    last_state=InstanceState(state),
                    last_ended_at=ended_at,
                    succeeded=succeeded,
                    ended=ended,
                )
                for key, state, ended_at, succeeded, ended in await conn.execute(query)
            }
            durations = await self._durations(conn, since, keys)
        for key, values in durations.items():
            summary = out.get(key) or JobSummary(key=key)
            out[key] = JobSummary(
                key=key,
                last_state=summary.last_state,
                last_ended_at=summary.last_ended_at,
                succeeded=summary.succeeded,
                ended=summary.ended,
                p95_duration_s=percentile_cont(values, 0.95),
            )
        return out

    async def _durations(
        self, conn: AsyncConnection, since: datetime, keys: Collection[str] | None
    ) -> dict[str, list[float]]:
        """Seconds from claim to end of each attempt that ended after ``since``, per job. An
        attempt is the pair of history records sharing its claim token: → Processing, and
        Processing → its end (succeeded, failed, cancelled, released, terminated)."""
        start = instance_transitions.alias("start")
        end = instance_transitions.alias("end")
        query = (
            select(job_instances.c.job_key, start.c.at, end.c.at)
            .select_from(end)
            .join(
                start,
                and_(
                    start.c.instance_id == end.c.instance_id,
                    start.c.claim_token == end.c.claim_token,
                    start.c.to_state == InstanceState.PROCESSING.value,
                ),
            )
            .join(job_instances, job_instances.c.id == end.c.instance_id)
            .where(end.c.from_state == InstanceState.PROCESSING.value, end.c.at >= since)
        )
        if keys is not None:
            query = query.where(job_instances.c.job_key.in_(list(keys)))
        out: dict[str, list[float]] = {}
        for key, started, ended in await conn.execute(query):
            out.setdefault(key, []).append((ended - started).total_seconds())
        return out

    async def throughput(
        self,
        width_s: int,
        count: int,
        job_key: str | None = None,
        *,
        job_keys: Collection[str] | None = None,
    ) -> list[Bucket]:
        # SQLite: bucket on the epoch seconds of ``at`` (stored as UTC text).
        async with self._read() as conn:
            now = await self._now(conn)
            last = int(now.timestamp()) // width_s * width_s
            first = last - width_s * (count - 1)
            start = cast(func.strftime("%s", transition_cols.at), Integer) // width_s * width_s
            query = (
                select(start.label("start"), transition_cols.to_state, func.count())
                .where(
                    transition_cols.at >= datetime.fromtimestamp(first, UTC),
                    transition_cols.to_state.in_(ENDS),
                )
                .group_by(start, transition_cols.to_state)
            )
            if job_key is not None or job_keys is not None:
                query = query.join(job_instances, job_instances.c.id == transition_cols.instance_id)
            if job_key is not None:
                query = query.where(job_instances.c.job_key == job_key)
            if job_keys is not None:
                query = query.where(job_instances.c.job_key.in_(list(job_keys)))
            counts: dict[tuple[int, str], int] = {
                (at, state): n for at, state, n in await conn.execute(query)
            }
        return [
            Bucket(
                start=datetime.fromtimestamp(at, UTC),
                succeeded=counts.get((at, InstanceState.SUCCEEDED.value), 0),
                failed=counts.get((at, InstanceState.FAILED.value), 0),
                terminated=counts.get((at, InstanceState.TERMINATED.value), 0),
            )
            for at in range(first, last + 1, width_s)
        ]

    async def lags(self, window_s: float = HOUR_S) -> Lags:
        # SQLite: the pairs are read and the percentiles taken here.
        async with self._read() as conn:
            since = await self._now(conn) - timedelta(seconds=window_s)
            fires = [
                (created - scheduled).total_seconds()
                for created, scheduled in await conn.execute(_fire_pairs(since))
            ]
            pickups = [
                (claimed - enqueued).total_seconds()
                for claimed, enqueued in await conn.execute(_pickup_pairs(since))
                if enqueued is not None
            ]
        return Lags(
            fire_p95_s=percentile_cont(fires, 0.95),
            fires=len(fires),
            pickup_p95_s=percentile_cont(pickups, 0.95),
            pickups=len(pickups),
        )


def _fire_pairs(since: datetime) -> Select[Any]:
    """(created, scheduled) of the cron ticks created since ``since``: a range of the primary
    key (time-ordered ids), not a scan."""
    return select(job_instances.c.created_at, job_instances.c.scheduled_at).where(
        job_instances.c.id >= id_floor(since - ID_CLOCK_SKEW),
        job_instances.c.created_at >= since,
        job_instances.c.source == "cron",
        job_instances.c.state
        != InstanceState.SKIPPED.value,  # misfire records: ticks that were never run
        job_instances.c.scheduled_at.is_not(None),
    )


def _pickup_pairs(since: datetime) -> Select[Any]:
    """(claimed, enqueued) of each claim recorded since ``since`` (the history's ``at``
    index), with the instance's latest → Enqueued before it (its (instance, seq) index)."""
    claim = instance_transitions.alias("claim")
    queued = instance_transitions.alias("queued")
    enqueued_at = (
        select(queued.c.at)
        .where(
            queued.c.instance_id == claim.c.instance_id,
            queued.c.seq < claim.c.seq,
            queued.c.to_state == InstanceState.ENQUEUED.value,
        )
        .order_by(queued.c.seq.desc())
        .limit(1)
        .scalar_subquery()
    )
    return select(claim.c.at, enqueued_at).where(
        claim.c.to_state == InstanceState.PROCESSING.value, claim.c.at >= since
    )
