"""Cancels through a running worker: queued, running (heartbeat alone), racing a timeout or a
failure. A cancel requested for an instance always wins over a retry. Postgres and Redis."""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast
from uuid import UUID

import pytest

from jobplane import App, Cancellation, JobContext
from jobplane.bus.abc import Bus
from jobplane.dispatch import Dispatcher
from jobplane.domain.reasons import StopReason
from jobplane.domain.states import InstanceState as S
from jobplane.store.sql import SqlStore
from tests.worker_helpers import running_worker, settled, wait_for

pytestmark = pytest.mark.timeout(60)


def test_a_cancel_after_a_timeout_is_still_recorded() -> None:
    signal = Cancellation()
    calls: list[str | None] = []
    signal.on_set(lambda: calls.append(signal.reason))
    signal.set(StopReason.TIMEOUT)
    # (Read into a name: an assert on the property itself would narrow it to False for the
    # type checker, which does not know that ``set`` changes it.)
    requested_by_timeout = signal.cancel_requested
    assert not requested_by_timeout
    signal.set(StopReason.CANCEL_REQUESTED)
    assert signal.is_set() and signal.reason == "timeout" and signal.cancel_requested
    assert calls == ["timeout"]  # the callbacks ran once, for the first reason


async def _processing(store: SqlStore, instance_id: UUID) -> None:
    async def running() -> bool:
        return (await store.get_instance(instance_id)).state is S.PROCESSING

    await wait_for(running, what="the instance to run")


async def test_a_cancel_during_the_timeout_grace_ends_it_cancelled_not_retried(
    pg_store: SqlStore, redis_bus: Bus
) -> None:
    app = App("grace")

    @app.triggered(timeout_s=0.3, retries=2, backoff={"kind": "none"})
    async def stubborn() -> None:
        await asyncio.sleep(30)  # ignores the timeout's signal: cancelled after the grace

    async with running_worker(app, pg_store, redis_bus, timeout_grace_s=1.5) as worker:
        instance = await Dispatcher(pg_store, redis_bus).trigger("stubborn")

        async def timed_out() -> bool:
            attempt = worker.attempt_of(instance.id)
            return attempt is not None and attempt.ctx.cancellation.reason == "timeout"

        await wait_for(timed_out, what="the timeout's signal")
        await Dispatcher(pg_store, redis_bus).cancel(instance.id, "test")
        [done] = await settled(pg_store, [instance.id])
    assert done.state is S.CANCELLED and done.retries_used == 0 and done.attempt == 1
    assert S.FAILED not in [t.to_state for t in await pg_store.transitions(done.id)]


async def test_a_failure_after_a_cancel_request_ends_cancelled_not_retried(
    pg_store: SqlStore, redis_bus: Bus
) -> None:
    app = App("failing")
    go = asyncio.Event()
    runs: list[int] = []

    @app.triggered(retries=3, backoff={"kind": "none"})
    async def fails(ctx: JobContext) -> None:
        runs.append(ctx.attempt)
        await go.wait()
        raise ValueError("failed after the cancel was requested")

    # Slow heartbeats and no bus event: the worker never hears of the cancel; the store decides.
    async with running_worker(app, pg_store, redis_bus, heartbeat_s=10.0, lease_s=60.0):
        instance = await Dispatcher(pg_store, redis_bus).trigger("fails")
        await _processing(pg_store, instance.id)
        await pg_store.request_cancel(instance.id, "test")
        go.set()
        [done] = await settled(pg_store, [instance.id])
    assert done.state is S.CANCELLED and done.retries_used == 0 and runs == [1]
    assert done.error is not None and done.error.type == "ValueError"
    history = [(t.from_state, t.to_state) for t in await pg_store.transitions(done.id)]
    assert history[-1] == (S.PROCESSING, S.CANCELLED)


async def test_a_cancel_while_queued_ends_it_without_running(
    pg_store: SqlStore, redis_bus: Bus
) -> None:
    app = App("queued")
    release = asyncio.Event()
    ran: list[str] = []

    @app.triggered()
    async def blocker() -> None:
        await release.wait()

    @app.triggered()
    async def victim(ctx: JobContext) -> None:
        ran.append(str(ctx.instance_id))

    async with running_worker(app, pg_store, redis_bus, concurrency=1):
        dispatcher = Dispatcher(pg_store, redis_bus)
        first = await dispatcher.trigger("blocker")
        await _processing(pg_store, first.id)
        queued = await dispatcher.trigger("victim")  # the worker is full: it stays queued
        cancelled = await dispatcher.cancel(queued.id, "test")
        assert cancelled.state is S.CANCELLED
        release.set()
        await settled(pg_store, [first.id])

        async def entry_dropped() -> bool:
            return not any((await redis_bus.stream_lengths("default")).values())

        # The worker reads the cancelled instance's entry, its claim drops it, it is acked.
        await wait_for(entry_dropped, what="the entry to be dropped")
    assert ran == []
    done = await pg_store.get_instance(queued.id)
    assert done.state is S.CANCELLED and done.attempt == 0
    history = [(t.from_state, t.to_state) for t in await pg_store.transitions(done.id)]
    assert history == [(None, S.ENQUEUED), (S.ENQUEUED, S.CANCELLED)]


async def test_a_cancel_reaches_a_running_job_by_the_heartbeat_alone(
    pg_store: SqlStore, redis_bus: Bus
) -> None:
    app = App("heartbeat")

    @app.triggered(retries=2)
    async def endless() -> None:
        await asyncio.sleep(30)

    heartbeat_s = 0.2
    async with running_worker(app, pg_store, redis_bus, heartbeat_s=heartbeat_s):
        instance = await Dispatcher(pg_store, redis_bus).trigger("endless")
        await _processing(pg_store, instance.id)
        requested = time.monotonic()
        await pg_store.request_cancel(instance.id, "test")  # the flag only: no bus event
        [done] = await settled(pg_store, [instance.id], timeout_s=10 * heartbeat_s)
        took = time.monotonic() - requested
    assert done.state is S.CANCELLED and done.retries_used == 0
    assert took < 10 * heartbeat_s


async def test_an_instance_released_with_a_cancel_pending_is_not_run_again(
    pg_store: SqlStore, redis_bus: Bus
) -> None:
    app = App("released")
    runs: list[int] = []

    @app.triggered()
    async def long(ctx: JobContext) -> None:
        runs.append(ctx.attempt)
        await asyncio.sleep(30)

    # The first worker stops (releasing the instance) before a heartbeat tells it of the cancel.
    async with running_worker(
        app, pg_store, redis_bus, heartbeat_s=10.0, lease_s=60.0, grace_s=0.1
    ):
        instance = await Dispatcher(pg_store, redis_bus).trigger("long")
        await _processing(pg_store, instance.id)
        await pg_store.request_cancel(instance.id, "test")
    released = await pg_store.get_instance(instance.id)
    assert released.state is S.ENQUEUED and released.cancel_requested  # and republished
    async with running_worker(app, pg_store, redis_bus) as second:
        [done] = await settled(pg_store, [instance.id])
    assert done.state is S.CANCELLED and runs == [1]
    last = (await pg_store.transitions(done.id))[-1]
    assert (last.from_state, last.to_state, last.actor) == (S.ENQUEUED, S.CANCELLED, second.id)


class _CancelledBeforeTheClaimAnswers:
    """The real store, but the answer to a claim waits until a cancel of what it claimed was
    requested and announced (as when the request comes while the answer is on its way)."""

    def __init__(self, store: SqlStore, bus: Bus) -> None:
        self.store = store
        self.dispatcher = Dispatcher(store, bus)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def claim(self, *args: Any, **kwargs: Any) -> Any:
        result = await self.store.claim(*args, **kwargs)
        for claim in result.claimed:
            await self.dispatcher.cancel(claim.instance.id, "test")
        await asyncio.sleep(0.5)  # the announcement reaches the worker meanwhile
        return result


async def test_a_cancel_announced_before_the_claim_answers_stops_the_attempt(
    pg_store: SqlStore, redis_bus: Bus
) -> None:
    """The announcement found no attempt yet and was dropped: the job ran until a heartbeat
    brought the cancel, and one shorter than that ended Succeeded, though its cancel had been
    accepted while it ran."""
    app = App("early-cancel")

    @app.triggered()
    async def short() -> str:
        await asyncio.sleep(1.0)
        return "ran to its end"

    store = _CancelledBeforeTheClaimAnswers(pg_store, redis_bus)
    async with running_worker(app, cast(SqlStore, store), redis_bus, heartbeat_s=10, lease_s=30):
        instance = await Dispatcher(pg_store, redis_bus).trigger("short")
        [done] = await settled(pg_store, [instance.id], timeout_s=20)
    assert done.state is S.CANCELLED, (done.state, done.result)
