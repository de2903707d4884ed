"""The scheduler in-process, on every store. Tests of what reaches the bus run on both buses;
tests of the schedule alone (what is recorded when: pauses, edits, misfires, start and end
dates) use the in-memory bus, since the bus plays no part in what they check, and drive the
leader's clock (``DrivenClock``) instead of waiting for the ticks."""

from __future__ import annotations

import itertools
import time
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import pytest
from sqlalchemy import select, update

from jobplane.bus.abc import Bus
from jobplane.bus.envelope import Envelope
from jobplane.bus.redis import RedisBus
from jobplane.definitions import announce
from jobplane.dispatch import Dispatcher
from jobplane.domain.models import (
    Instance,
    InstanceFilter,
    NewInstance,
    WorkerInfo,
)
from jobplane.domain.states import InstanceState as S
from jobplane.store.sql import SqlStore
from jobplane.store.tables import job_instances
from jobplane_scheduler.duties import LeaderDuties
from jobplane_scheduler.settings import SchedulerSettings
from tests.scheduler_helpers import (
    FAST,
    DrivenClock,
    advance_until,
    applied,
    fired_earlier,
    running_scheduler,
)
from tests.store_helpers import define
from tests.worker_helpers import wait_for


async def _cron_instances(store: SqlStore, key: str) -> list[Instance]:
    page = await store.list_instances(InstanceFilter(job_key=key), limit=5000)
    return sorted((i for i in page.items), key=_tick)


def _tick(instance: Instance) -> datetime:
    """A cron instance's tick (every one has one)."""
    assert instance.scheduled_at is not None, instance
    return instance.scheduled_at


def _ticks(instances: list[Instance]) -> list[datetime]:
    return [_tick(i) for i in instances]


async def test_every_second_job_fires_on_the_second(store: SqlStore, memory_bus: Bus) -> None:
    # On the real clock (the lag is measured against the database's); what reaches each bus
    # is checked below.
    await define(store, "tick", cron="* * * * * *")
    async with running_scheduler(store, memory_bus) as scheduler:
        await wait_for(lambda: _count(store, "tick", 3), timeout_s=10, what="three ticks")
        assert scheduler.lease is not None
    fired = await _cron_instances(store, "tick")
    for instance in fired:
        assert instance.scheduled_at is not None and instance.scheduled_at.microsecond == 0
        lag = (instance.created_at - instance.scheduled_at).total_seconds()
        assert 0 <= lag < 1.0  # created after its tick, never before (measured in bench/)
        assert instance.state is S.ENQUEUED and instance.published_at is not None
    seconds = _ticks(fired)
    assert all(b - a == timedelta(seconds=1) for a, b in itertools.pairwise(seconds))
    assert (await store.get_leader(0)) is None  # released on stop


async def test_a_fired_tick_reaches_the_bus(store: SqlStore, bus: Bus) -> None:
    await define(store, "tick", cron="* * * * * *")
    clock = DrivenClock(store)
    async with running_scheduler(store, bus, clock=clock):
        await advance_until(clock, lambda: _enqueued(store, "tick"), 1, what="a tick")
        # The job's schedule began when it was defined: if a real second passed before the
        # first advance, an earlier tick was due too and was fired or skipped by the misfire
        # policy; every tick that was enqueued must be on the bus.
        fired = [i for i in await _cron_instances(store, "tick") if i.state is S.ENQUEUED]
        assert fired and all(tick.published_at is not None for tick in fired)
        deliveries = await bus.consumer("w1", ["default"]).read(10, 500)
        assert {tick.id for tick in fired} <= {d.envelope.instance_id for d in deliveries}


async def _count(store: SqlStore, key: str, n: int) -> bool:
    return await _total(store, key) >= n


async def _enqueued(store: SqlStore, key: str) -> int:
    return (await store.count_by_state(key)).get(S.ENQUEUED, 0)


async def _total(store: SqlStore, key: str) -> int:
    return sum((await store.count_by_state(key)).values())


async def test_edited_cron_applies_on_the_next_fire(store: SqlStore, memory_bus: Bus) -> None:
    opts = await define(store, "tick", cron="0 0 1 1 *")  # once a year
    clock = DrivenClock(store)
    async with running_scheduler(store, memory_bus, clock=clock) as scheduler:
        await applied(scheduler, "tick")
        await clock.passed(await clock.advance(0.5))
        assert await store.count_by_state("tick") == {}
        saved = await store.save_definition(
            opts.edited(cron="* * * * * *"), expected_version=1, actor="test"
        )
        assert saved is not None
        await applied(scheduler, "tick", saved.version)
        await advance_until(clock, lambda: _total(store, "tick"), 2, what="the edited cron")


async def test_pause_then_resume_follows_the_misfire_policy(
    store: SqlStore, memory_bus: Bus
) -> None:
    await define(store, "tick", cron="* * * * * *")
    clock = DrivenClock(store)
    async with running_scheduler(store, memory_bus, clock=clock) as scheduler:
        await advance_until(clock, lambda: _total(store, "tick"), 1, what="a first tick")
        paused = await store.set_paused("tick", True, "test")
        await applied(scheduler, "tick", paused.version, paused=True)
        paused_at = await _total(store, "tick")
        await clock.passed(await clock.advance(3.0))  # three ticks' time
        assert await _total(store, "tick") == paused_at  # no fires
        resumed = await store.set_paused("tick", False, "test")
        await applied(scheduler, "tick", resumed.version)
        await advance_until(
            clock, lambda: _total(store, "tick"), paused_at + 3, what="catch-up after resume"
        )
    fired = await _cron_instances(store, "tick")
    skipped = [i for i in fired if i.state is S.SKIPPED]
    assert skipped and all(i.reason == "misfire" for i in skipped)
    ticks = _ticks(fired)
    assert len(ticks) == len(set(ticks))  # one record per tick
    assert all(b - a == timedelta(seconds=1) for a, b in itertools.pairwise(ticks))


async def test_debug_mode_never_fires_cron(store: SqlStore, memory_bus: Bus) -> None:
    await define(store, "tick", cron="* * * * * *")
    clock = DrivenClock(store)
    async with running_scheduler(store, memory_bus, clock=clock, debug_no_auto_cron=True) as s:
        await applied(s, "tick")
        await clock.passed(await clock.advance(2.2))  # two ticks' time and more
    assert await store.count_by_state("tick") == {}


async def test_no_tick_after_end_at_on_any_replan(store: SqlStore, memory_bus: Bus) -> None:
    now = (await store.now()).replace(microsecond=0)
    end = now - timedelta(seconds=30)
    # One job never fired; one whose last tick was its end_at (recorded by an earlier leader).
    await define(store, "never", cron="* * * * * *", end_at=end)
    await define(store, "ended", cron="* * * * * *", end_at=end)
    await fired_earlier(store, ["ended"], end)
    clock = DrivenClock(store)
    async with running_scheduler(store, memory_bus, clock=clock) as scheduler:
        await applied(scheduler, "never")
        await applied(scheduler, "ended")
        await clock.passed(await clock.advance(2.5))  # two and more one-second ticks
        # A pause and resume re-plans both jobs again.
        await store.set_paused("never", True, "test")
        resumed = await store.set_paused("never", False, "test")
        await applied(scheduler, "never", resumed.version)
        await clock.passed(await clock.advance(1.5))
    assert await store.count_by_state("never") == {}
    assert [i.scheduled_at for i in await _cron_instances(store, "ended")] == [end]


async def test_the_tick_at_start_at_fires(store: SqlStore, memory_bus: Bus) -> None:
    start = (await store.now()).replace(microsecond=0) + timedelta(seconds=3)
    start += timedelta(seconds=start.second % 2)  # an even second: one of the job's ticks
    await define(store, "tick", cron="* * * * * */2", start_at=start)
    clock = DrivenClock(store)
    async with running_scheduler(store, memory_bus, clock=clock) as scheduler:
        await applied(scheduler, "tick")
        for n, at in enumerate([start, start + timedelta(seconds=2)], 1):
            await clock.advance_to(at)
            await wait_for(lambda n=n: _count(store, "tick", n), timeout_s=10, what="a tick")
    ticks = [i.scheduled_at for i in await _cron_instances(store, "tick")]
    assert ticks[:2] == [start, start + timedelta(seconds=2)]


async def test_a_long_outage_records_every_missed_tick(store: SqlStore, memory_bus: Bus) -> None:
    # 1,200 ticks missed with misfire_max=10: recorded in passes, all of them, then on time.
    await define(store, "tick", cron="* * * * * *", misfire_max=10)
    first = (await store.now()).replace(microsecond=0) - timedelta(seconds=1_200)
    await fired_earlier(store, ["tick"], first)
    clock = DrivenClock(store)
    async with running_scheduler(store, memory_bus, clock=clock):
        await wait_for(lambda: _count(store, "tick", 1_201), timeout_s=30, what="the backfill")
        await advance_until(clock, lambda: _total(store, "tick"), 1_205, what="ticks after it")
    fired = await _cron_instances(store, "tick")
    ticks = _ticks(fired)
    assert ticks[0] == first
    assert all(b - a == timedelta(seconds=1) for a, b in itertools.pairwise(ticks))
    late = [i for i in fired[1:] if i.state is S.ENQUEUED]
    assert late and all(i.reason is None for i in late)
    missed = [i for i in fired if i.state is S.SKIPPED]
    assert len(missed) >= 1_190 and all(i.reason == "misfire" for i in missed)


async def test_a_sitting_leader_that_falls_behind_follows_the_misfire_policy(
    store: SqlStore, memory_bus: Bus
) -> None:
    # The leader's loop is frozen for 3 s (a pause shorter than its lease: no failover). Ticks
    # later than the 1 s grace follow each job's policy, as they would after a failover.
    await define(store, "skip", cron="* * * * * *", misfire="skip")
    await define(store, "all", cron="* * * * * *", misfire="fire_all")
    clock = DrivenClock(store)
    async with running_scheduler(store, memory_bus, clock=clock, lease_ttl_s=10.0) as scheduler:
        await advance_until(clock, lambda: _total(store, "skip"), 2, what="on-time ticks")
        term = scheduler.lease.term if scheduler.lease else None
        # The leader's time jumps 3 s in one step, as over a pause of its whole process: the
        # loop wakes to ticks later than their grace.
        await clock.advance(3.0)
        await advance_until(clock, lambda: _total(store, "skip"), 7, what="ticks after it")
        assert scheduler.lease is not None and scheduler.lease.term == term
    skip = await _cron_instances(store, "skip")
    missed = [i for i in skip if i.state is S.SKIPPED]
    assert missed and all(i.reason == "misfire" for i in missed)
    ticks = _ticks(skip)
    assert all(b - a == timedelta(seconds=1) for a, b in itertools.pairwise(ticks))
    fire_all = await _cron_instances(store, "all")
    assert not [i for i in fire_all if i.state is S.SKIPPED]


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
async def test_a_leader_whose_whole_loop_froze_keeps_its_term_and_the_misfire_policy(
    store: SqlStore, memory_bus: Bus
) -> None:
    # The same, on the real clock with the event loop really blocked for 3 s (as in a pause of
    # the process): the lease renewals stop too, and a pause shorter than the lease must not
    # cost the term. On one store: what it adds is the blocked loop, not the store.
    await define(store, "skip", cron="* * * * * *", misfire="skip")
    async with running_scheduler(store, memory_bus, lease_ttl_s=10.0) as scheduler:
        await wait_for(lambda: _count(store, "skip", 2), timeout_s=10, what="on-time ticks")
        term = scheduler.lease.term if scheduler.lease else None
        time.sleep(3.0)  # noqa: ASYNC251 (the point: the whole leader stops, as in a pause)
        await wait_for(lambda: _count(store, "skip", 7), timeout_s=10, what="ticks after it")
        assert scheduler.lease is not None and scheduler.lease.term == term
    skip = await _cron_instances(store, "skip")
    missed = [i for i in skip if i.state is S.SKIPPED]
    assert missed and all(i.reason == "misfire" for i in missed)
    assert all(b - a == timedelta(seconds=1) for a, b in itertools.pairwise(_ticks(skip)))


async def test_an_edited_cron_catches_up_from_the_edit_not_the_last_occurrence(
    store: SqlStore, memory_bus: Bus
) -> None:
    # A yearly job that last fired 30 s ago is edited to every second: the new schedule's
    # ticks before the edit never existed (none back-dated, none recorded Skipped). Its misfire
    # policy fires every late tick: a tick after the edit that a loaded machine makes later
    # than the grace is then fired, not legitimately Skipped; a tick from before the edit would
    # still show, back-dated.
    opts = await define(store, "yearly", cron="0 0 1 1 *", misfire="fire_all")
    first = (await store.now()).replace(microsecond=0) - timedelta(seconds=30)
    await fired_earlier(store, ["yearly"], first)
    clock = DrivenClock(store)
    async with running_scheduler(store, memory_bus, clock=clock) as scheduler:
        await applied(scheduler, "yearly")
        saved = await store.save_definition(
            opts.edited(cron="* * * * * *"), expected_version=1, actor="test"
        )
        assert saved is not None and saved.schedule_since is not None
        await announce(memory_bus, [saved])
        await applied(scheduler, "yearly", saved.version)
        await advance_until(clock, lambda: _total(store, "yearly"), 4, what="the new ticks")
    fired = await _cron_instances(store, "yearly")
    assert fired[0].scheduled_at == first
    after = fired[1:]
    assert all(tick > saved.schedule_since for tick in _ticks(after))
    assert not [i for i in after if i.state is S.SKIPPED]
    # An edit that leaves the schedule alone keeps its start.
    other = await store.save_definition(
        saved.options.edited(retries=2), expected_version=saved.version, actor="test"
    )
    assert other is not None and other.schedule_since == saved.schedule_since


async def test_replicas_are_listed_while_they_campaign_and_forgotten_when_they_stop(
    store: SqlStore, bus: Bus
) -> None:
    async with (
        running_scheduler(store, bus, scheduler_id="s-one") as one,
        running_scheduler(store, bus, scheduler_id="s-two") as two,
    ):

        async def both_seen_one_leading() -> bool:
            seen = {r.holder for r in await store.list_schedulers(0)}
            return seen == {"s-one", "s-two"} and (one.lease is None) != (two.lease is None)

        await wait_for(both_seen_one_leading, what="two replicas, one leader")
        leader = await store.get_leader(0)
        assert leader is not None and leader.holder in {"s-one", "s-two"}
    assert await store.list_schedulers(0) == []  # a clean stop forgets its replica


async def test_a_replica_silent_for_an_hour_is_pruned_by_the_next_campaign(
    store: SqlStore,
) -> None:
    from jobplane.store.tables import scheduler_replicas

    long_ago = await store.now() - timedelta(hours=2)
    async with store.engine.begin() as conn:
        await conn.execute(
            scheduler_replicas.insert().values(
                shard=0, holder="s-dead", started_at=long_ago, seen_at=long_ago
            )
        )
    await store.scheduler_seen(0, "s-live")
    await store.scheduler_seen(1, "s-other-shard")
    assert [r.holder for r in await store.list_schedulers(0)] == ["s-live"]
    await store.scheduler_gone(0, "s-live")
    assert await store.list_schedulers(0) == []
    assert [r.holder for r in await store.list_schedulers(1)] == ["s-other-shard"]


async def test_a_gone_workers_stream_keeps_no_entry_of_what_was_given_away(
    store: SqlStore, bus: Bus
) -> None:
    """An instance pinned to a worker that stopped for good is unpinned by the leader and
    published on its queue; its old entry leaves the gone worker's stream, which nobody reads
    any more (left there, it would stay for good)."""
    await define(store, "job")
    gone = WorkerInfo(id="gone", host="h", pid=1, queues=("default",), capacity=1, version="x")
    await store.register_worker(gone)
    async with Dispatcher(store, bus) as dispatcher:  # (sent on leaving)
        made = await dispatcher.trigger("job", pinned_worker="gone")
    old = Envelope(instance_id=made.id, job_key="job", priority=made.priority, pinned_worker="gone")
    assert await bus.queued([("default", old)]) == {made.id}
    await store.worker_stopped("gone")

    async def old_entry_gone() -> bool:
        return not await bus.queued([("default", old)])

    async with running_scheduler(store, bus):
        await wait_for(old_entry_gone, what="the old entry's removal")
    assert (await store.get_instance(made.id)).pinned_worker is None
    [delivery] = await bus.consumer("w1", ["default"]).read(10, 50)
    assert delivery.envelope.instance_id == made.id and delivery.envelope.pinned_worker is None


async def test_the_republish_sweep_walks_a_backlog_and_finds_a_message_lost_deep_in_it(
    store: SqlStore, redis_bus: Bus
) -> None:
    """2,500 instances wait, published long enough ago to be looked for, and the message of
    one deep in the stream is lost. The sweep walks the backlog a page (1,000) at a time,
    publishes that one again within a round, and rewrites nothing it found in place: the
    others' publication times do not move, and the stream grows by that one copy only."""
    assert isinstance(redis_bus, RedisBus)
    await define(store, "job", max_concurrency=10_000)
    async with Dispatcher(store, redis_bus) as dispatcher:
        made = await dispatcher.trigger_many([NewInstance(job_key="job") for _ in range(2500)])
    lost = made[2200].id
    envelope = Envelope(lost, "job", made[2200].priority)
    key = redis_bus.keys.stream_of("default", envelope)
    entries: Any = await redis_bus.client.xrange(key, count=3000)
    [entry] = [e for e, fields in entries if str(lost) in fields[b"d"].decode()]
    assert await redis_bus.client.xdel(key, entry) == 1
    before = await _published_times(store)

    async def republished() -> bool:
        return (await _published_times(store))[lost] != before[lost]

    async with running_scheduler(store, redis_bus, republish_after_s=0.5):
        await wait_for(republished, timeout_s=15, what="the lost message published again")
        after = await _published_times(store)
    assert {i for i in before if after[i] != before[i]} == {lost}
    assert await redis_bus.queued([("default", envelope)]) == {lost}
    assert sum((await redis_bus.stream_lengths("default")).values()) == 2500


async def _published_times(store: SqlStore) -> dict[UUID, datetime | None]:
    async with store.engine.connect() as conn:
        found = await conn.execute(select(job_instances.c.id, job_instances.c.published_at))
        return {row.id: row.published_at for row in found}


async def test_the_republish_walk_waits_at_the_newest_until_its_round_is_due(
    store: SqlStore, bus: Bus
) -> None:
    """Once the walk has looked at every stale instance it waits at the newest: the next
    sweeps take only the instances newly stale, at once, until ``republish_after_s`` has
    passed since the walk began; then it begins again from the oldest. (A small backlog that
    waits is looked for once per ``republish_after_s``, not at every sweep.)"""
    await define(store, "job", max_concurrency=1000)

    async def published_ago(count: int, minutes: int) -> list[UUID]:
        made = await store.create_instances([NewInstance(job_key="job") for _ in range(count)])
        ids = [i.id for i in made]
        at = await store.now() - timedelta(minutes=minutes)
        async with store.engine.begin() as conn:
            await conn.execute(
                update(job_instances).where(job_instances.c.id.in_(ids)).values(published_at=at)
            )
        return sorted(ids)

    old = await published_ago(3, 60)
    lease = await store.acquire_leadership(0, "s-walk", 30)
    assert lease is not None
    values: dict[str, Any] = {**FAST, "scheduler_id": "s-walk", "republish_after_s": 60.0}
    settings = SchedulerSettings(**values)
    duties = LeaderDuties(store, bus, settings, lease)
    assert [i.id for i in await duties._stale()] == old
    assert await duties._stale() == []  # at the newest: waits
    newer = await published_ago(1, 30)
    assert [i.id for i in await duties._stale()] == newer  # newly stale: at once
    assert await duties._stale() == []
    duties._walk_began -= 61  # its round is due: the next page begins from the oldest
    assert await duties._stale() == []
    assert [i.id for i in await duties._stale()] == [*old, *newer]
