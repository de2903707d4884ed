"""A new leader's catch-up of many jobs at once: bounded per pass, with turns for the lease's
renewal, so that the leader keeps its term, fires the current ticks and records every missed
one per its job's misfire policy."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from datetime import datetime, timedelta
from typing import Any, cast

import pytest
from sqlalchemy import func, select

from jobplane.bus.abc import Bus
from jobplane.domain.models import InstanceSource, NewInstance
from jobplane.domain.options import JobOptions
from jobplane.domain.states import InstanceState
from jobplane.store.abc import LeaderStore
from jobplane.store.sql import SqlStore
from jobplane.store.tables import job_instances, scheduler_leases
from jobplane_scheduler.duties import LeaderDuties
from jobplane_scheduler.firing import FIRE_CHUNK, REPLAN_BUDGET
from jobplane_scheduler.settings import SchedulerSettings
from tests.scheduler_helpers import FAST, fired_earlier, running_scheduler
from tests.worker_helpers import wait_for

#: 200 one-second jobs, 5 minutes behind: 60,000 missed ticks. In one pass (every job's
#: catch-up computed without a turn for anything else) that held the event loop for about a
#: second here, more on a loaded machine: past a short lease, the term ended before the fire,
#: and every next term began with the same pass. (The lease here is 3 s, so that the suite's
#: load does not end a term by itself; the next test shows the pass's bounds without timing.)
JOBS, GAP_S, LEASE_S = 200, 300, 3.0


async def _register(store: SqlStore, keys: list[str], **options: Any) -> None:
    for key in keys:
        parsed = JobOptions.parse(key=key, kind="recurring", cron="* * * * * *", **options)
        await store.register_definition(parsed, None, "test")


async def _ticks(store: SqlStore) -> dict[str, list[tuple[datetime, str]]]:
    """Every job's cron occurrences, oldest first: (tick, state)."""
    query = select(job_instances.c.job_key, job_instances.c.scheduled_at, job_instances.c.state)
    query = query.where(job_instances.c.source == InstanceSource.CRON.value)
    async with store.engine.connect() as conn:
        rows = (await conn.execute(query.order_by(job_instances.c.scheduled_at))).all()
    out: dict[str, list[tuple[datetime, str]]] = defaultdict(list)
    for key, at, state in rows:
        out[key].append((at, state))
    return out


async def _terms(store: SqlStore) -> int:
    async with store.engine.connect() as conn:
        return int(await conn.scalar(select(scheduler_leases.c.term)) or 0)


@pytest.mark.long
async def test_a_new_leader_far_behind_on_many_jobs_keeps_its_term_and_catches_up(
    pg_store: SqlStore, memory_bus: Bus
) -> None:
    keys = [f"j{i:03d}" for i in range(JOBS)]
    await _register(pg_store, keys)
    start = (await pg_store.now()).replace(microsecond=0)
    await fired_earlier(pg_store, keys, start - timedelta(seconds=GAP_S))
    earlier_term = await _terms(pg_store)
    async with running_scheduler(pg_store, memory_bus, lease_ttl_s=LEASE_S) as scheduler:

        async def current() -> bool:
            # Every job fired a tick due after the leader began: caught up, and firing. (One
            # aggregate: reading every row here held the loop the leader shares with it.)
            latest = (
                select(func.max(job_instances.c.scheduled_at).label("at"))
                .where(job_instances.c.source == InstanceSource.CRON.value)
                .group_by(job_instances.c.job_key)
                .subquery()
            )
            async with pg_store.engine.connect() as conn:
                oldest = await conn.scalar(select(func.min(latest.c.at)))
            now = await pg_store.now()
            return oldest is not None and oldest >= max(
                start + timedelta(seconds=2), now - timedelta(seconds=5)
            )

        await wait_for(current, timeout_s=60, what="every job to fire its current ticks")
        # One term: the first, never lost to a pass that kept the renewal from running.
        assert scheduler.lease is not None and scheduler.lease.term == earlier_term + 1
        ticks = await _ticks(pg_store)
    for key in keys:
        ats = [at for at, _ in ticks[key]]
        # Every tick from the earlier leader's last one on, once: none lost, none doubled.
        assert ats == [ats[0] + timedelta(seconds=s) for s in range(len(ats))], key
        assert ats[0] == start - timedelta(seconds=GAP_S)
        # fire_once: of the ticks missed by more than the grace, all Skipped but the latest
        # of each catch-up (a few, as a job waiting for its pass falls behind again).
        missed = [state for at, state in ticks[key][1:] if at <= start - timedelta(seconds=2)]
        skipped = missed.count(InstanceState.SKIPPED.value)
        assert skipped >= len(missed) - 10, (key, skipped, len(missed))


async def test_a_replan_pass_is_bounded_and_leaves_turns_to_the_other_tasks(
    pg_store: SqlStore, memory_bus: Bus
) -> None:
    """What keeps the lease renewed, shown without timing it: a pass plans jobs until their
    records reach the budget (the others wait in the backfill, their timers dropped), writes
    them a chunk at a time, and lets other tasks run between jobs; the next passes plan the
    rest, every missed tick once and per the policy."""
    jobs, gap = 60, 200  # (12,000 records: more than a pass takes)
    keys = [f"b{i:02d}" for i in range(jobs)]
    await _register(pg_store, keys, misfire="fire_all", misfire_max=5)
    start = (await pg_store.now()).replace(microsecond=0)
    await fired_earlier(pg_store, keys, start - timedelta(seconds=gap))
    lease = await pg_store.acquire_leadership(0, "s-1", 60)
    assert lease is not None
    sizes: list[int] = []

    async def fire(lease: Any, records: list[NewInstance], **kw: Any) -> Any:
        sizes.append(len(records))
        return await pg_store.fire(lease, records, **kw)

    store = cast(LeaderStore, _With(pg_store, fire=fire))
    values: dict[str, Any] = {**FAST, "scheduler_id": "s-1"}
    settings = SchedulerSettings(**values)
    duties = LeaderDuties(store, memory_bus, settings, lease)
    turns = 0

    async def other_task() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    other = asyncio.create_task(other_task())
    try:
        await duties.cache.reload_all()
        await asyncio.sleep(0)
        began = turns
        await duties._replan(set(keys))
        planned = jobs - len(duties._backfill)
        # The other task ran between jobs (and between chunks), not only at the reads.
        assert turns - began >= planned
    finally:
        other.cancel()
    assert REPLAN_BUDGET <= sum(sizes) < REPLAN_BUDGET + gap
    assert planned == -(-REPLAN_BUDGET // gap)
    assert max(sizes) <= FIRE_CHUNK
    assert not set(duties._backfill) & set(duties.timers._schedules)
    passes = 1
    while duties._backfill:
        await duties._replan(set(duties._backfill))
        passes += 1
        assert passes <= jobs
    assert set(duties.timers._schedules) == set(keys)
    ticks = await _ticks(pg_store)
    for key in keys:
        ats = [at for at, _ in ticks[key]]
        assert ats == [ats[0] + timedelta(seconds=s) for s in range(len(ats))], key
        assert ats[0] == start - timedelta(seconds=gap) and ats[-1] >= start
        # fire_all, misfire_max 5: the latest 5 ticks missed (more than the grace late) when
        # its pass looked fire; every earlier one is Skipped.
        states = [state for at, state in ticks[key][1:] if at <= start - timedelta(seconds=10)]
        assert states == [InstanceState.SKIPPED.value] * len(states), key
        assert len(states) >= gap - 10


class _With:
    """A store whose named methods are replaced (the others pass through)."""

    def __init__(self, inner: Any, **methods: Any) -> None:
        self._inner, self._methods = inner, methods

    def __getattr__(self, name: str) -> Any:
        return self._methods.get(name) or getattr(self._inner, name)
