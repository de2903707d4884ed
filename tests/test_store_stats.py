"""Statistics of the store (jobs list figures, throughput), on Postgres and SQLite: the same
answers from both, computed from real claims, completions and history."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from itertools import pairwise
from uuid import UUID

import pytest
from sqlalchemy import select, update

from jobplane.domain.models import Outcome
from jobplane.domain.states import InstanceState as S
from jobplane.store.sql import SqlStore
from jobplane.store.stats import percentile_cont
from jobplane.store.tables import instance_transitions, job_instances
from tests.store_helpers import define, enqueue

T = instance_transitions.c
MINUTE = timedelta(minutes=1)
HOUR = timedelta(hours=1)


async def _run(store: SqlStore, key: str, outcomes: list[S]) -> list[UUID]:
    """Claim and end one instance of ``key`` per outcome, for real."""
    instances = await enqueue(store, key, len(outcomes))
    claimed = (await store.claim([i.id for i in instances], "w1", 30, [key])).claimed
    assert len(claimed) == len(outcomes)
    by_id = {c.instance.id: c for c in claimed}
    await store.complete(
        [
            Outcome(i.id, by_id[i.id].token, state)
            for i, state in zip(instances, outcomes, strict=True)
        ]
    )
    return [i.id for i in instances]


async def _set_attempt(
    store: SqlStore, instance_id: UUID, ended_ago_s: float, duration_s: float
) -> None:
    """Move an attempt's history (and the instance's end) back in time: it was claimed
    ``duration_s`` before it ended, ``ended_ago_s`` ago. Only the times change."""
    now = await store.now()
    ended = now - timedelta(seconds=ended_ago_s)
    async with store.engine.begin() as conn:
        seqs = (
            await conn.execute(
                select(T.seq, T.to_state).where(T.instance_id == instance_id).order_by(T.seq)
            )
        ).all()
        for seq, to_state in seqs:
            at = ended - timedelta(seconds=duration_s) if to_state == "processing" else ended
            if to_state == "enqueued":
                at -= timedelta(seconds=duration_s + 1)
            await conn.execute(update(instance_transitions).where(T.seq == seq).values(at=at))
        await conn.execute(
            update(job_instances)
            .where(job_instances.c.id == instance_id, job_instances.c.finished_at.is_not(None))
            .values(finished_at=ended)
        )


def test_percentile_cont_interpolates_like_postgres() -> None:
    assert percentile_cont([], 0.95) is None
    assert percentile_cont([7.0], 0.95) == 7.0
    assert percentile_cont([4.0, 1.0, 3.0, 2.0], 0.95) == pytest.approx(3.85)
    assert percentile_cont([1.0, 2.0], 0.5) == 1.5


async def test_job_summaries_for_every_job_in_one_call(store: SqlStore) -> None:
    await define(store, "a", max_concurrency=4)
    await define(store, "b")
    await define(store, "idle")
    ids = await _run(store, "a", [S.SUCCEEDED, S.SUCCEEDED, S.FAILED, S.CANCELLED])
    for n, instance_id in enumerate(ids):
        await _set_attempt(store, instance_id, ended_ago_s=60 * (10 - n), duration_s=n + 1)
    [old] = await _run(store, "b", [S.SUCCEEDED])
    await _set_attempt(store, old, ended_ago_s=25 * 3600, duration_s=5)
    await enqueue(store, "idle")

    summaries = await store.job_summaries()
    a = summaries["a"]
    # Failed with no retries left ends Terminated: 4 ended, 2 succeeded.
    assert (a.ended, a.succeeded, a.success_rate) == (4, 2, 0.5)
    assert a.last_state is S.CANCELLED  # the one that ended last
    assert a.p95_duration_s == pytest.approx(3.85, abs=0.01)  # of 1, 2, 3, 4 s
    b = summaries["b"]
    # Ended 25 h ago: still its latest outcome, but outside the 24 h figures.
    assert b.last_state is S.SUCCEEDED and b.last_ended_at is not None
    assert (b.ended, b.success_rate, b.p95_duration_s) == (0, None, None)
    assert (await store.now()) - b.last_ended_at > timedelta(hours=24)
    idle = summaries.get("idle")
    assert idle is None or (idle.last_state, idle.success_rate) == (None, None)

    only = await store.job_summaries(["b"])
    assert set(only) == {"b"} and only["b"] == b


def _bucket_of(at: datetime, width_s: int) -> datetime:
    return datetime.fromtimestamp(int(at.timestamp()) // width_s * width_s, UTC)


async def test_throughput_buckets_ends_per_minute_and_per_hour(store: SqlStore) -> None:
    await define(store, "a", max_concurrency=4)
    await define(store, "other")
    recent, older, failed, lost = await _run(
        store, "a", [S.SUCCEEDED, S.SUCCEEDED, S.FAILED, S.FAILED]
    )
    await _set_attempt(store, recent, ended_ago_s=5 * 60, duration_s=1)
    await _set_attempt(store, older, ended_ago_s=2 * 3600, duration_s=1)
    await _set_attempt(store, failed, ended_ago_s=5 * 60, duration_s=1)
    await _set_attempt(store, lost, ended_ago_s=30 * 3600, duration_s=1)  # out of both
    await _run(store, "other", [S.SUCCEEDED])  # now
    now = await store.now()

    minutes = await store.throughput(60, 60, "a")
    assert len(minutes) == 60 and minutes[-1].start <= now < minutes[-1].start + MINUTE
    assert all(b.start + MINUTE == n.start for b, n in pairwise(minutes))
    by_start = {b.start: b for b in minutes}
    five_ago = by_start[_bucket_of(now - 5 * MINUTE, 60)]
    # No retry left: the failed attempt is followed by the instance's termination.
    assert (five_ago.succeeded, five_ago.failed, five_ago.terminated) == (1, 1, 1)
    assert sum(b.succeeded + b.failed + b.terminated for b in minutes) == 3

    hours = await store.throughput(3600, 24, "a")
    assert len(hours) == 24 and hours[-1].start <= now < hours[-1].start + HOUR
    assert sum(b.succeeded for b in hours) == 2 and sum(b.failed for b in hours) == 1
    two_ago = {b.start: b for b in hours}[_bucket_of(now - 2 * HOUR, 3600)]
    assert two_ago.succeeded == 1

    everything = await store.throughput(60, 60)
    assert sum(b.succeeded for b in everything) == 2  # "a" 5 min ago and "other" now
    assert sum(b.succeeded for b in await store.throughput(60, 60, "nope")) == 0


async def test_fire_and_pickup_lag_p95_over_the_last_hour(store: SqlStore) -> None:
    from jobplane.domain.models import InstanceSource, NewInstance

    await define(store, "tick", cron="* * * * *")
    await define(store, "work", max_concurrency=8)
    now = await store.now()
    # Ticks created now, 1..4 s after their scheduled second; a misfire record (skipped, an
    # hour late) and a manual trigger do not count.
    ticks = [
        NewInstance(
            job_key="tick",
            source=InstanceSource.CRON,
            scheduled_at=now - timedelta(seconds=lag, minutes=n),
        )
        for n, lag in enumerate((1, 2, 3, 4))
    ]
    misfire = NewInstance(
        job_key="tick",
        source=InstanceSource.CRON,
        scheduled_at=now - HOUR,
        skip_reason="misfire",
    )
    made = await store.create_instances([*ticks, misfire, NewInstance(job_key="tick")])
    fire_lags = [
        (i.created_at - t.scheduled_at).total_seconds()
        for i, t in zip(made[:4], ticks, strict=True)
        if t.scheduled_at is not None
    ]
    assert all(lag >= 1 for lag in fire_lags)

    # Four claims 10 min ago, 2, 4, 6 and 8 s after their enqueue; one 2 h ago (outside).
    claimed = await _run(store, "work", [S.SUCCEEDED] * 5)
    for instance_id, (ago, lag) in zip(
        claimed, [(600, 2), (600, 4), (600, 6), (600, 8), (7200, 100)], strict=True
    ):
        async with store.engine.begin() as conn:
            for state, at in (("enqueued", ago + lag), ("processing", ago), ("succeeded", ago)):
                await conn.execute(
                    update(instance_transitions)
                    .where(T.instance_id == instance_id, T.to_state == state)
                    .values(at=now - timedelta(seconds=at))
                )

    lags = await store.lags()
    assert lags.fires == 4 and lags.pickups == 4
    assert lags.fire_p95_s == pytest.approx(percentile_cont(fire_lags, 0.95), abs=0.01)
    assert lags.pickup_p95_s == pytest.approx(percentile_cont([2, 4, 6, 8], 0.95), abs=0.01)
    last_minute = await store.lags(window_s=60)  # the ticks were created now; no claim
    assert last_minute.fires == 4 and (last_minute.pickups, last_minute.pickup_p95_s) == (0, None)
