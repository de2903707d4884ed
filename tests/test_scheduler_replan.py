"""Re-plans that do not go in one go: one that fails (a short outage) after the cache took the
new definitions, a long outage's catch-up, written in passes; and a window reopened after its
end."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from jobplane.bus.abc import Bus
from jobplane.definitions import announce
from jobplane.domain.models import (
    DefinitionChange,
    DefinitionVersion,
    InstanceFilter,
    JobDefinition,
    LeaderLease,
)
from jobplane.domain.options import JobOptions
from jobplane.store.abc import LeaderStore
from jobplane.store.sql import SqlStore
from jobplane_scheduler.cron_timers import BACKFILL_BATCH, earlier_spans
from jobplane_scheduler.duties import LeaderDuties
from jobplane_scheduler.scheduler import Scheduler
from jobplane_scheduler.settings import SchedulerSettings
from tests.scheduler_helpers import (
    FAST,
    DrivenClock,
    advance_until,
    applied,
    fired_earlier,
    running_scheduler,
    swept,
)
from tests.store_helpers import define
from tests.worker_helpers import FlakyStore, wait_for


@asynccontextmanager
async def _paused_job_leader(
    store: SqlStore, bus: Bus
) -> AsyncIterator[tuple[Scheduler, FlakyStore, DrivenClock]]:
    """A leader, on a store whose calls a test can refuse, that has applied the paused
    one-second job "tick". Sweeps far apart: an event, not a sweep, brings an edit first."""
    await define(store, "tick", cron="* * * * * *")
    paused = await store.set_paused("tick", True, "test")
    flaky, clock = FlakyStore(store), DrivenClock(store)
    leader = cast(LeaderStore, flaky)
    async with running_scheduler(leader, bus, clock=clock, sweep_interval_s=1.5) as scheduler:
        await applied(scheduler, "tick", paused.version, paused=True)
        yield scheduler, flaky, clock


async def _resume_refusing(
    store: SqlStore, bus: Bus, flaky: FlakyStore, call: str
) -> JobDefinition:
    """Resume "tick" and announce it, the leader's next ``call`` of the store refused."""
    flaky.fail_next[call] = 1
    resumed = await store.set_paused("tick", False, "test")
    await announce(bus, [resumed])

    async def refused() -> bool:
        return bool(flaky.refusals(call))

    await wait_for(refused, what=f"the leader's {call} to be refused")
    return resumed


async def _total(store: SqlStore, key: str) -> int:
    return sum((await store.count_by_state(key)).values())


async def test_a_job_resumed_while_its_replan_fails_is_planned_by_the_next_sweep(
    store: SqlStore, memory_bus: Bus
) -> None:
    """The resume's event reached the leader, which cached the resumed definition and then
    failed to re-plan it (its read of the job's last tick refused: the event is dropped). The
    cache said "up to date" to every later version check: the job never fired again in this
    term. (The same for an edit: the old schedule went on.)"""
    async with _paused_job_leader(store, memory_bus) as (scheduler, flaky, clock):
        resumed = await _resume_refusing(store, memory_bus, flaky, "last_occurrences")
        await applied(scheduler, "tick", resumed.version)
        await swept(scheduler, 2)  # the backstop's version check
        await advance_until(clock, lambda: _total(store, "tick"), 2, what="ticks after the resume")


async def test_every_pass_of_a_backfill_looks_from_when_the_first_one_did(
    pg_store: SqlStore, memory_bus: Bus
) -> None:
    """600 ticks of a ``skip`` job missed: two passes. The tick 0.6 s before the first pass
    was within the grace (1 s) and fires; the second pass, 0.5 s later, took it for missed
    (and fired the next one, which the timer fires after the backfill instead)."""
    options = JobOptions.parse(key="tick", kind="recurring", cron="* * * * * *", misfire="skip")
    definition = JobDefinition(options=options, version=1)
    first = datetime(2026, 5, 1, 12, 10, 0, 600_000, tzinfo=UTC)
    lease = LeaderLease(0, "s-1", 1, first, first + timedelta(seconds=30))
    values: dict[str, Any] = {**FAST, "scheduler_id": "s-1"}
    settings = SchedulerSettings(**values)
    duties = LeaderDuties(cast(LeaderStore, pg_store), memory_bus, settings, lease)
    tick = first.replace(microsecond=0)
    made = duties._plan(definition, tick - timedelta(seconds=600), first)
    assert len(made) == BACKFILL_BATCH
    last = made[-1].scheduled_at
    rest = duties._plan(definition, last, first + timedelta(seconds=0.5))
    assert [m.skip_reason for m in rest] == ["misfire"] * 99 + [None]
    assert rest[-1].scheduled_at == tick
    assert duties.timers.next_time() == tick + timedelta(seconds=1)


async def test_a_catch_up_whose_write_failed_is_written_before_any_later_tick(
    store: SqlStore, memory_bus: Bus
) -> None:
    """A job resumed after ticks were missed: the re-plan planned its timer, then the write of
    its catch-up failed (the event dropped). The timer fired the next ticks meanwhile, and the
    next re-plan caught up from the latest of them: the missed ticks were never recorded, and
    fire_once's latest one never fired."""
    async with _paused_job_leader(store, memory_bus) as (scheduler, flaky, clock):
        await clock.passed(await clock.advance(4.0))  # ticks missed while paused
        await _resume_refusing(store, memory_bus, flaky, "fire")
        await swept(scheduler, 2)  # the backstop's version check re-plans it
        await advance_until(clock, lambda: _total(store, "tick"), 8, what="ticks")
    page = await store.list_instances(InstanceFilter(job_key="tick"), limit=1000)
    ticks = sorted(i.scheduled_at for i in page.items if i.scheduled_at is not None)
    [job] = await store.list_definitions(["tick"])
    began = job.schedule_since or job.created_at
    assert began is not None
    assert ticks[0] == began.replace(microsecond=0) + timedelta(seconds=1)  # the first missed
    assert all(b - a == timedelta(seconds=1) for a, b in itertools.pairwise(ticks))


async def test_a_window_reopened_after_its_end_fires_nothing_from_before_the_edit(
    store: SqlStore, memory_bus: Bus
) -> None:
    """A one-second job's window ended 30 s ago (its last tick at the end); its end is moved
    on. The ticks between the old end and the edit were outside its window when they came:
    counted from the last occurrence they were taken for missed, and fire_all fired all 30
    back-dated (a minutely job that ended a month ago: hundreds at once)."""
    now = (await store.now()).replace(microsecond=0)
    end = now - timedelta(seconds=30)
    opts = await define(
        store,
        "ended",
        cron="* * * * * *",
        misfire="fire_all",
        start_at=end - timedelta(seconds=60),
        end_at=end,
    )
    await fired_earlier(store, ["ended"], end)
    clock = DrivenClock(store)
    async with running_scheduler(store, memory_bus, clock=clock) as scheduler:
        await applied(scheduler, "ended")
        reopened = await store.save_definition(
            opts.edited(end_at=now + timedelta(hours=1)), expected_version=1, actor="test"
        )
        assert reopened is not None and reopened.schedule_since is not None
        edited_at = reopened.schedule_since
        await announce(memory_bus, [reopened])
        await applied(scheduler, "ended", reopened.version)
        await advance_until(clock, lambda: _ticks_after(store, edited_at), 2)
    fired = (await store.list_instances(InstanceFilter(job_key="ended"), limit=1000)).items
    between = [i for i in fired if i.scheduled_at and end < i.scheduled_at <= edited_at]
    assert between == [], [i.scheduled_at for i in between]
    # Extended while it still ran, or shortened: the schedule goes on as it was.
    longer = await store.save_definition(
        reopened.options.edited(end_at=now + timedelta(hours=2)),
        expected_version=reopened.version,
        actor="test",
    )
    assert longer is not None and longer.schedule_since == reopened.schedule_since


async def _ticks_after(store: SqlStore, moment: datetime) -> int:
    page = await store.list_instances(InstanceFilter(job_key="ended"), limit=1000)
    return sum(1 for i in page.items if i.scheduled_at and i.scheduled_at > moment)


async def test_a_schedule_edited_during_a_backfill_catches_up_the_old_one_to_the_edit(
    pg_store: SqlStore, memory_bus: Bus
) -> None:
    """A one-second job 2,000 ticks behind: its backfill's first pass looked from L; its
    schedule was edited 5 s later (E). The next passes still looked from L, so the old
    schedule's ticks in (L, E] were in no pass, and the timer planned from the edit: lost,
    with no record."""
    created = datetime(2026, 5, 1, 11, tzinfo=UTC)
    last = datetime(2026, 5, 1, 12, tzinfo=UTC)
    old = JobOptions.parse(key="tick", kind="recurring", cron="* * * * * *")
    values: dict[str, Any] = {**FAST, "scheduler_id": "s-1"}
    lease = LeaderLease(0, "s-1", 1, last, last + timedelta(seconds=30))
    duties = LeaderDuties(
        cast(LeaderStore, pg_store), memory_bus, SchedulerSettings(**values), lease
    )
    first = last + timedelta(seconds=2000)
    made = duties._plan(JobDefinition(options=old, version=1, created_at=created), last, first)
    assert len(made) == BACKFILL_BATCH and "tick" in duties._backfill
    edited_at = first + timedelta(seconds=5)
    new = old.edited(cron="*/2 * * * * *")
    edited = JobDefinition(options=new, version=2, created_at=created, schedule_since=edited_at)
    history = [
        DefinitionVersion("tick", 1, old, False, DefinitionChange.REGISTER, "test", created),
        DefinitionVersion("tick", 2, new, False, DefinitionChange.EDIT, "test", edited_at),
    ]
    spans = earlier_spans(history, edited_at)
    now = edited_at + timedelta(seconds=3)
    for _ in range(10):
        made += duties._plan(edited, made[-1].scheduled_at, now, spans)
        if "tick" not in duties._backfill:
            break
    ticks = [m.scheduled_at for m in made if m.scheduled_at is not None]
    assert len(set(ticks)) == len(ticks) == len(made)
    seconds = int((edited_at - last).total_seconds())
    assert [t for t in ticks if t <= edited_at] == [
        last + timedelta(seconds=s) for s in range(1, seconds + 1)
    ]
    # fire_once: every tick missed is Skipped but the latest, which fires (as do those within
    # the grace at ``now``).
    fired = [m.scheduled_at for m in made if m.skip_reason is None and m.scheduled_at]
    assert fired and all(t > now - timedelta(seconds=2) for t in fired[1:])
    next_time = duties.timers.next_time()
    assert next_time is not None and next_time > max(ticks)
