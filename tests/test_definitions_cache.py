"""The definition cache, on every store and bus combination, and the leader's use of it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from datetime import timedelta

import pytest
from sqlalchemy import delete
from sqlalchemy.exc import IntegrityError

from jobplane.bus.abc import Bus
from jobplane.bus.envelope import Event, EventKind
from jobplane.definitions import DefinitionCache, announce
from jobplane.domain.models import InstanceFilter, InstanceSource, NewInstance
from jobplane.errors import JobNotFoundError, StoreRefusedError
from jobplane.store.sql import SqlStore
from jobplane.store.tables import job_definitions, job_instances
from tests.scheduler_helpers import DrivenClock, advance_until, running_scheduler
from tests.store_helpers import define
from tests.worker_helpers import wait_for


async def _edit(store: SqlStore, key: str, **changes: object) -> int:
    """Save an edit in Postgres only: no mark, no event (as if Redis had lost both)."""
    current = await store.get_definition(key)
    saved = await store.save_definition(
        current.options.edited(**changes), expected_version=current.version, actor="test"
    )
    assert saved is not None
    return saved.version


async def test_serves_from_memory_until_told(store: SqlStore, bus: Bus) -> None:
    await define(store, "a", cron="0 * * * *")
    cache = DefinitionCache(store, bus)
    assert [d.key for d in await cache.all()] == ["a"]
    await _edit(store, "a", description="edited")
    # No mark, no event: the copy in memory is what is served...
    assert (await cache.get("a")).version == 1
    # ...until the periodic version check against Postgres finds the change.
    assert await cache.refresh(verify=True) == {"a"}
    assert (await cache.get("a")).options.description == "edited"


async def test_a_pending_mark_reloads_only_its_key(store: SqlStore, bus: Bus) -> None:
    for key in ("a", "b"):
        await define(store, key, cron="0 * * * *")
    cache = DefinitionCache(store, bus)
    await cache.all()
    version_a = await _edit(store, "a", description="new a")
    await _edit(store, "b", description="new b")
    await bus.set_pending_updates({"a": version_a})  # only a's edit was announced
    assert await cache.refresh() == {"a"}
    cached = cache.definitions
    assert cached["a"].options.description == "new a"
    assert cached["b"].version == 1  # b was not reloaded: nothing said it changed


async def test_an_old_mark_reloads_nothing(store: SqlStore, bus: Bus) -> None:
    await define(store, "a", cron="0 * * * *")
    cache = DefinitionCache(store, bus)
    await cache.all()
    await bus.set_pending_updates({"a": 1})  # the version already cached
    assert await cache.refresh(["a"]) == set()


async def test_event_reloads_the_keys_it_names(store: SqlStore, bus: Bus) -> None:
    await define(store, "a", cron="0 * * * *")
    cache = DefinitionCache(store, bus)
    await cache.all()
    await _edit(store, "a", max_concurrency=4)
    changed = await cache.apply_event(Event(EventKind.DEFINITIONS_CHANGED, {"keys": ["a"]}))
    assert changed == {"a"} and cache.definitions["a"].options.max_concurrency == 4
    other = Event(EventKind.LEADER_RESIGNED, {"shard": 0})
    assert await cache.apply_event(other) == set()


async def test_new_and_unknown_keys(store: SqlStore, bus: Bus) -> None:
    cache = DefinitionCache(store, bus)
    assert await cache.all() == []
    await define(store, "late")  # registered by a worker after the cache loaded
    assert (await cache.get("late")).key == "late"
    with pytest.raises(JobNotFoundError):
        await cache.get("nope")


async def test_announce_marks_then_tells(store: SqlStore, bus: Bus) -> None:
    await define(store, "a", cron="0 * * * *")
    version = await _edit(store, "a", description="x")
    events = bus.subscribe()
    assert isinstance(events, AsyncGenerator)  # (both buses subscribe with one: it closes)
    first = asyncio.ensure_future(anext(events))
    await asyncio.sleep(0.1)  # subscribed before the event goes out
    await announce(bus, [await store.get_definition("a")])
    assert await bus.get_pending_updates(["a"]) == {"a": version}
    event = await asyncio.wait_for(first, 5)
    assert event.kind is EventKind.DEFINITIONS_CHANGED and event.data == {"keys": ["a"]}
    await events.aclose()


async def test_leader_applies_a_pending_update_before_firing(store: SqlStore, bus: Bus) -> None:
    """The edit's event is lost and the version check is a minute away: the mark alone makes
    the very next fire use the new options (here: the job was paused)."""
    await define(store, "tick", cron="* * * * * *")
    clock = DrivenClock(store)
    async with running_scheduler(store, bus, clock=clock, sweep_interval_s=60):
        await advance_until(clock, lambda: _fired_count(store), 1, what="a first tick")
        current = await store.get_definition("tick")
        paused = await store.set_paused("tick", True, "test")
        await bus.set_pending_updates({"tick": paused.version})  # the mark, not the event
        assert paused.version == current.version + 1
        settled = await _fired_count(store)
        await clock.passed(await clock.advance(2.5))  # two ticks' time and more
        # At most the tick being fired while the edit was saved; no tick after it.
        assert await _fired_count(store) <= settled + 1
        before = await _fired_count(store)
        await clock.passed(await clock.advance(1.5))
        assert await _fired_count(store) == before


async def test_a_pause_whose_event_and_mark_are_both_lost_stops_the_next_tick(
    store: SqlStore, bus: Bus
) -> None:
    """Neither the event nor the mark reaches the leader (Redis restarted in between), and
    the version check is a minute away: the fire itself finds the job stored at a newer
    version than its tick was planned under, writes nothing of it, and the job is read again
    (paused: no tick after it)."""
    await define(store, "tick", cron="* * * * * *")
    clock = DrivenClock(store)
    async with running_scheduler(store, bus, clock=clock, sweep_interval_s=60):
        await advance_until(clock, lambda: _fired_count(store), 1, what="a first tick")
        await store.set_paused("tick", True, "test")  # no announce: no event, no mark
        settled = await _fired_count(store)
        await clock.passed(await clock.advance(2.5))
        assert await _fired_count(store) <= settled + 1  # the one being fired, at most
        before = await _fired_count(store)
        await clock.passed(await clock.advance(1.5))
        assert await _fired_count(store) == before


async def _fired_count(store: SqlStore, key: str = "tick") -> int:
    page = await store.list_instances(InstanceFilter(job_key=key), limit=1000)
    return len(page.items)


async def test_a_definition_deleted_behind_the_leader_s_back_is_dropped_not_fatal(
    store: SqlStore, bus: Bus
) -> None:
    """No command deletes a definition, but an operator may, in SQL (its instances first, for
    the foreign key). The leader's next fire names the job, the database refuses the fire
    for it: the job is read again, leaves the cache with its timers, and the other jobs keep
    firing. The fire's error no longer ends the leader's duties (and its process)."""
    for key in ("kept", "gone"):
        await define(store, key, cron="* * * * * *")
    clock = DrivenClock(store)
    async with running_scheduler(store, bus, clock=clock, sweep_interval_s=60):
        await advance_until(clock, lambda: _fired_count(store, "gone"), 1, what="a first tick")
        await _delete_job(store, "gone")
        kept = await _fired_count(store, "kept")
        await advance_until(clock, lambda: _fired_count(store, "kept"), kept + 3, what="kept")
        assert await _fired_count(store, "gone") == 0


async def test_a_job_gone_while_a_refused_batch_is_fired_job_by_job_is_skipped(
    store: SqlStore, bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    """The database refused a tick's batch (a poison job) and the leader fires it job by job,
    without the version fence: a job whose definition is gone by then is skipped with a
    line, and the others fire. (Its error does not end the leader's duties.)"""
    await define(store, "kept", cron="0 0 1 1 *")
    async with running_scheduler(store, bus, sweep_interval_s=60) as scheduler:

        async def leading() -> bool:
            return scheduler._leader is not None

        await wait_for(leading, timeout_s=10, what="leadership")
        duties = scheduler._leader
        assert duties is not None
        tick = (await store.now()).replace(microsecond=0) + timedelta(days=1)
        records = [
            NewInstance(job_key=key, source=InstanceSource.CRON, scheduled_at=tick)
            for key in ("kept", "gone")
        ]
        refused = StoreRefusedError("the batch was refused", "23514")
        fired = await duties._fire_each_job(records, refused, marks=True)
    assert [i.job_key for i in fired] == ["kept"]
    gone = [r for r in caplog.records if getattr(r, "action", "") == "scheduler.job_gone"]
    assert [getattr(r, "job_key", None) for r in gone] == ["gone"]


async def _delete_job(store: SqlStore, key: str) -> None:
    """Delete a job's instances and its definition in one transaction, as an operator would
    in SQL; again if a tick fired in between (the foreign key then refuses the delete)."""
    for _ in range(5):
        try:
            async with store.engine.begin() as conn:
                await conn.execute(delete(job_instances).where(job_instances.c.job_key == key))
                await conn.execute(delete(job_definitions).where(job_definitions.c.key == key))
            return
        except IntegrityError:
            continue
    raise AssertionError(f"could not delete job {key}")
