"""The ticks of a schedule replaced by an edit while they were being missed: the leader down,
or the job paused, across the edit. They were due under the schedule of the time, so they
are missed ticks like any other: the misfire policy fires or records each one, and none
vanishes. The new schedule's ticks still begin at the edit."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from jobplane.bus.abc import Bus
from jobplane.definitions import announce
from jobplane.domain.models import (
    DefinitionChange,
    DefinitionVersion,
    Instance,
    InstanceFilter,
    JobDefinition,
)
from jobplane.domain.options import JobOptions
from jobplane.domain.states import InstanceState as S
from jobplane.store.sql import SqlStore
from jobplane_scheduler.cron_timers import catch_up, earlier_spans
from tests.scheduler_helpers import applied, fired_earlier, running_scheduler
from tests.store_helpers import define
from tests.worker_helpers import wait_for

YEARLY = "0 0 1 1 *"


async def _cron_ticks(store: SqlStore, key: str) -> list[Instance]:
    page = await store.list_instances(InstanceFilter(job_key=key), limit=5000)
    return sorted(page.items, key=lambda i: i.scheduled_at or datetime.min.replace(tzinfo=UTC))


def _seconds(first: datetime, last: datetime) -> list[datetime]:
    """Every whole second in ``[first, last]``."""
    start = first if first.microsecond == 0 else first.replace(microsecond=0) + timedelta(seconds=1)
    return [start + timedelta(seconds=s) for s in range(int((last - start).total_seconds()) + 1)]


@pytest.mark.parametrize("policy", ["skip", "fire_all", "fire_once"])
async def test_the_old_schedules_ticks_missed_across_an_edit_follow_the_policy(
    store: SqlStore, memory_bus: Bus, policy: str
) -> None:
    # A one-second job last fired 6 s ago; while no leader runs it is edited to a yearly
    # schedule. The seconds between its last tick and the edit were due: before, the catch-up
    # started at the edit and they were neither fired nor recorded.
    opts = await define(store, "tick", cron="* * * * * *", misfire=policy, misfire_grace_s=0.5)
    first = (await store.now()).replace(microsecond=0) - timedelta(seconds=6)
    await fired_earlier(store, ["tick"], first)
    saved = await store.save_definition(opts.edited(cron=YEARLY), expected_version=1, actor="t")
    assert saved is not None and saved.schedule_since is not None
    since = saved.schedule_since
    await asyncio.sleep(0.7)  # (every old tick is then past the grace: the policy decides)
    due = _seconds(first + timedelta(seconds=1), since)
    async with running_scheduler(store, memory_bus) as scheduler:
        await applied(scheduler, "tick", saved.version)

        async def caught_up() -> bool:
            return len(await _cron_ticks(store, "tick")) >= 1 + len(due)

        await wait_for(caught_up, what="the old schedule's missed ticks")
    instances = (await _cron_ticks(store, "tick"))[1:]
    assert [i.scheduled_at for i in instances] == due  # each once, none after the edit
    skipped = [i.scheduled_at for i in instances if i.state is S.SKIPPED]
    assert all(i.reason == "misfire" for i in instances if i.state is S.SKIPPED)
    expected = {"skip": due, "fire_all": [], "fire_once": due[:-1]}[policy]
    assert skipped == expected


async def test_ticks_missed_while_paused_across_an_edit_are_recorded_on_resume(
    store: SqlStore, memory_bus: Bus
) -> None:
    # A live leader: the job is paused, its schedule edited, then resumed. The seconds of the
    # pause before the edit were due under the old schedule; a resume catches them up per the
    # policy (skip: recorded Skipped), as it does a pause with no edit.
    opts = await define(store, "tick", cron="* * * * * *", misfire="skip", misfire_grace_s=0.5)
    async with running_scheduler(store, memory_bus) as scheduler:
        await applied(scheduler, "tick")

        async def fired_twice() -> bool:
            return len(await _cron_ticks(store, "tick")) >= 2

        await wait_for(fired_twice, what="two ticks")
        paused = await store.set_paused("tick", True, "test")
        await announce(memory_bus, [paused])
        await applied(scheduler, "tick", paused.version, paused=True)
        before = await _cron_ticks(store, "tick")
        await asyncio.sleep(2.2)
        edited = await store.save_definition(
            opts.edited(cron=YEARLY), expected_version=paused.version, actor="test"
        )
        assert edited is not None and edited.schedule_since is not None
        await announce(memory_bus, [edited])
        await asyncio.sleep(0.7)
        resumed = await store.set_paused("tick", False, "test")
        await announce(memory_bus, [resumed])
        await applied(scheduler, "tick", resumed.version)
        since = edited.schedule_since
        last = max(i.scheduled_at for i in before if i.scheduled_at is not None)
        due = _seconds(last + timedelta(seconds=1), since)
        assert len(due) >= 2

        async def caught_up() -> bool:
            ticks = [i.scheduled_at for i in await _cron_ticks(store, "tick")]
            return set(due) <= set(ticks)

        await wait_for(caught_up, what="the paused seconds before the edit")
    instances = await _cron_ticks(store, "tick")
    ticks = [i.scheduled_at for i in instances if i.scheduled_at is not None]
    assert ticks == _seconds(ticks[0], since)[: len(ticks)] and ticks[-1] == due[-1]
    assert all(i.state is S.SKIPPED and i.reason == "misfire" for i in instances[-len(due) :])


def _version(n: int, at: datetime, paused: bool = False, **options: Any) -> DefinitionVersion:
    parsed = JobOptions.from_stored({"key": "job", "kind": "recurring", **options})
    return DefinitionVersion("job", n, parsed, paused, DefinitionChange.EDIT, "test", at)


def test_each_replaced_schedule_has_its_ticks_until_the_next_version() -> None:
    # Four saves before the outage ended: every 10 s, then every 15 s from 12:01:00, paused
    # (same schedule) from 12:01:10, then yearly from 12:01:40. Each version's ticks count from
    # its own save to the next one's; a version whose expression never fires has none.
    t0 = datetime(2026, 5, 1, 12, 0, 0, tzinfo=UTC)
    at = [t0 + timedelta(seconds=s) for s in (0, 60, 70, 100)]
    versions = [
        _version(1, at[0], cron="* * * * * */10", misfire="fire_all"),
        _version(2, at[1], cron="0 0 30 2 *", misfire="fire_all"),
        _version(3, at[1] + timedelta(seconds=1), cron="* * * * * */15", misfire="fire_all"),
        _version(4, at[2], True, cron="* * * * * */15", misfire="fire_all"),
        _version(5, at[3], cron=YEARLY, misfire="fire_all"),
    ]
    current = JobDefinition(versions[-1].options, 5, created_at=t0, schedule_since=at[3])
    spans = earlier_spans(versions, at[3])
    caught = catch_up(current, t0 + timedelta(seconds=5), t0 + timedelta(seconds=200), spans)
    assert caught.complete and all(r.skip_reason is None for r in caught.records)
    seconds = [int((r.scheduled_at - t0).total_seconds()) for r in caught.records]  # type: ignore[operator]
    assert seconds == [10, 20, 30, 40, 50, 60, 75, 90]


async def test_the_history_of_many_jobs_is_read_at_once_from_each_ones_time(
    store: SqlStore,
) -> None:
    # Per job: the version in effect at its own time, then every later one, whatever the
    # other jobs' times in the same read.
    a = await define(store, "a", cron="* * * * *")
    b = await define(store, "b", cron="* * * * *")
    saved = [
        await store.save_definition(a.edited(retries=n), expected_version=n, actor="t")
        for n in (1, 2)
    ]
    b2 = await store.save_definition(b.edited(cron="*/5 * * * *"), expected_version=1, actor="t")
    assert b2 is not None and saved[0] is not None and saved[1] is not None
    long_ago = datetime(2000, 1, 1, tzinfo=UTC)
    found = await store.schedule_histories({"a": saved[0].updated_at or long_ago, "b": long_ago})
    assert [v.version for v in found["a"]] == [2, 3]
    assert [v.version for v in found["b"]] == [1, 2]
    assert found["b"][1].options.cron == "*/5 * * * *"
    later = await store.schedule_histories({"a": datetime(2100, 1, 1, tzinfo=UTC)})
    assert [v.version for v in later["a"]] == [3]
