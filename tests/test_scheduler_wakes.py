"""The leader's wakes between sweeps: at each delayed instance's run_at, and just after each
attempt's lease ends, so that neither waits for the next sweep. A delay made after the sweep
read what is due (a short delay, a retry's backoff) is announced by the store when it commits
(Postgres: a trigger's NOTIFY; SQLite: connection-local triggers, heard in the same process)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest

from jobplane.bus.abc import Bus
from jobplane.dispatch import Dispatcher
from jobplane.domain.models import ErrorInfo, Instance, LeaderLease, NewInstance, Outcome
from jobplane.domain.states import InstanceState as S
from jobplane.store.abc import LeaderStore
from jobplane.store.sql import SqlStore
from jobplane_scheduler.duties import LEASE_WAKE_WINDOW, SWEEP_BATCH, LeaderDuties, _lease_wakes
from jobplane_scheduler.settings import SchedulerSettings
from tests.scheduler_helpers import FAST, running_scheduler, swept
from tests.store_helpers import define
from tests.worker_helpers import wait_for


async def test_delayed_instance_is_promoted_when_due(store: SqlStore, memory_bus: Bus) -> None:
    await define(store, "job")
    async with running_scheduler(store, memory_bus):
        instance = await Dispatcher(store, memory_bus).trigger(
            "job", delay=timedelta(milliseconds=600)
        )
        assert instance.state is S.SCHEDULED

        async def enqueued() -> bool:
            return (await store.get_instance(instance.id)).state is S.ENQUEUED

        await wait_for(enqueued, timeout_s=10, what="promotion")
    history = await store.transitions(instance.id)
    promoted = history[-1]
    assert promoted.to_state is S.ENQUEUED and instance.run_at is not None
    assert promoted.at >= instance.run_at


async def test_a_lease_is_released_when_it_ends_not_at_the_next_sweep(
    store: SqlStore, memory_bus: Bus
) -> None:
    # A worker claimed the instance and died (it never renews). With sweeps 30 s apart, the
    # leader still releases the attempt just after its lease ends: it woke for that end.
    await define(store, "job")
    [instance] = await store.create_instances([NewInstance(job_key="job")])
    [claim] = (await store.claim([instance.id], "dead", 1.5, ["job"])).claimed
    async with running_scheduler(store, memory_bus, sweep_interval_s=30.0, reap_grace_s=0):

        async def released() -> bool:
            return (await store.get_instance(instance.id)).state is S.ENQUEUED

        await wait_for(released, timeout_s=15, what="the release")
    lease_end = claim.instance.lease_expires_at
    release = (await store.transitions(instance.id))[-1]
    assert release.from_state is S.PROCESSING and release.to_state is S.ENQUEUED
    assert lease_end is not None and release.at > lease_end
    assert (release.at - lease_end).total_seconds() < 5  # the next sweep: 30 s after the first


def test_leases_ending_close_together_are_released_by_one_wake() -> None:
    start = datetime(2030, 1, 1, tzinfo=UTC)
    ends = [start + timedelta(milliseconds=ms) for ms in (0, 10, 49, 50, 200)]
    window = LEASE_WAKE_WINDOW
    # Each end is released within the window after it: 0, 10 and 49 ms by one wake at 50 ms
    # (they have ended before it), 50 ms by the next, 200 ms by its own.
    assert _lease_wakes(ends) == [start + window, ends[3] + window, ends[4] + window]
    assert _lease_wakes([]) == []


@asynccontextmanager
async def _swept_once(store: SqlStore, bus: Bus) -> AsyncIterator[None]:
    """A leader whose sweeps are 30 s apart, once its first sweep has read what is due
    before the next: what is made Scheduled now only an announcement can wake it for."""
    async with running_scheduler(store, bus, sweep_interval_s=30.0) as scheduler:
        await swept(scheduler, 1)
        yield


async def _promoted_at_its_run_at(store: SqlStore, instance: Instance) -> None:
    """Wait for the Scheduled ``instance`` to be promoted; check it was at its run_at, not at
    the next sweep (30 s after the first, in these tests)."""
    assert instance.run_at is not None

    async def enqueued() -> bool:
        return (await store.get_instance(instance.id)).state is S.ENQUEUED

    await wait_for(enqueued, timeout_s=15, what="the promotion")
    promoted = (await store.transitions(instance.id))[-1]
    assert promoted.to_state is S.ENQUEUED and promoted.at >= instance.run_at
    assert (promoted.at - instance.run_at).total_seconds() < 5


async def test_a_short_delay_made_between_two_sweeps_is_promoted_at_its_run_at(
    store: SqlStore, memory_bus: Bus
) -> None:
    # Sweeps 30 s apart: the trigger comes after the leader's sweep read what is due before
    # the next one, so only the store's announcement can wake the leader for it (Postgres: a
    # NOTIFY; SQLite: the store's own, in this process).
    await define(store, "job")
    async with _swept_once(store, memory_bus):
        instance = await Dispatcher(store, memory_bus).trigger(
            "job", delay=timedelta(milliseconds=300)
        )
        assert instance.state is S.SCHEDULED
        await _promoted_at_its_run_at(store, instance)


async def test_a_retry_backoff_shorter_than_the_sweep_interval_starts_when_it_ends(
    store: SqlStore, memory_bus: Bus
) -> None:
    await define(store, "job", retries=1)
    [instance] = await store.create_instances([NewInstance(job_key="job")])
    [claim] = (await store.claim([instance.id], "w", 30, ["job"])).claimed
    async with _swept_once(store, memory_bus):
        error = ErrorInfo("RuntimeError", "boom", "Traceback ...")
        failed = Outcome(instance.id, claim.token, S.FAILED, error=error, retry_delay_s=0.3)
        await store.complete([failed])
        retry = await store.get_instance(instance.id)
        assert retry.state is S.SCHEDULED
        await _promoted_at_its_run_at(store, retry)


async def test_an_undecodable_due_time_is_logged_and_the_rest_taken(
    pg_store: SqlStore, memory_bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    # The channel carries enqueued ids and due times; a payload that is neither a number nor
    # an id (something else notifying on the channel) is logged, and the others still count.
    lease = LeaderLease(0, "s-1", 1, datetime.now(UTC), datetime.now(UTC) + timedelta(seconds=30))
    values: dict[str, Any] = {**FAST, "scheduler_id": "s-1"}
    settings = SchedulerSettings(**values)
    duties = LeaderDuties(cast(LeaderStore, pg_store), memory_bus, settings, lease)
    ids = duties._announce_due(["due:1767225600.25", "due:soon", "0190-id"])
    assert ids == ["0190-id"]
    assert duties._announced == [datetime(2026, 1, 1, 0, 0, 0, 250_000, tzinfo=UTC)]
    assert duties._announcing.is_set()
    assert "undecodable due-time notification 'due:soon'" in caplog.text


async def test_many_instances_due_at_once_are_all_promoted_by_one_wake(
    pg_store: SqlStore, memory_bus: Bus
) -> None:
    # More than a promotion batch (SWEEP_BATCH) due at the same moment, made after the sweep:
    # the wake promotes batch after batch, not one and the rest at the next sweep (30 s).
    await define(pg_store, "job")
    async with _swept_once(pg_store, memory_bus):
        run_at = await pg_store.now() + timedelta(milliseconds=500)
        made = await pg_store.create_instances(
            [NewInstance(job_key="job", run_at=run_at) for _ in range(SWEEP_BATCH + 500)]
        )
        assert all(i.state is S.SCHEDULED for i in made)

        async def all_enqueued() -> bool:
            return (await pg_store.count_by_state("job")).get(S.ENQUEUED, 0) == len(made)

        await wait_for(all_enqueued, timeout_s=15, what="every due instance promoted")
