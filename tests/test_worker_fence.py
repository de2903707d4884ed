"""Attempts the worker's fence stopped (it could not renew their lease in time): while their
code still runs their lease is kept if the store comes back, and once it has stopped what the
stop made the job do is not its outcome. Real Postgres (and SQLite) and Redis; the outage is
injected into the worker's store calls (see FlakyStore)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from uuid import UUID

import pytest

from jobplane import App, JobContext
from jobplane.bus.abc import Bus
from jobplane.dispatch import Dispatcher
from jobplane.domain.reasons import EndReason, StopReason
from jobplane.domain.states import InstanceState as S
from jobplane.store.sql import SqlStore
from jobplane_worker.attempt import Attempt, Ending, _raised, ending
from jobplane_worker.worker import Worker
from tests.scheduler_helpers import running_scheduler
from tests.store_helpers import define, enqueue
from tests.worker_helpers import FlakyStore, running_worker, settled, wait_for

pytestmark = pytest.mark.timeout(60)

LEASE_S = 2.0


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    """What the sync jobs of a test wait on; set at its end, so no thread outlives it."""
    made = threading.Event()
    yield made
    made.set()


async def _fenced(worker: Worker, instance_id: UUID) -> bool:
    attempt = worker.attempt_of(instance_id)
    return attempt is not None and attempt.fenced


async def test_a_fenced_sync_attempt_keeps_its_lease_while_its_code_runs(
    pg_store: SqlStore, redis_bus: Bus, gate: threading.Event
) -> None:
    """The store comes back after the fence stopped the attempt but before its lease ended:
    the lease is renewed while the thread runs on, so the reaper never hands the instance to
    another attempt beside it (it did, 0.4 s after the store was back: two copies at once)."""
    app = App("fenced-renewed")
    threads: list[int] = []

    @app.triggered(max_concurrency=1)
    def chunk(ctx: JobContext) -> str:
        threads.append(ctx.attempt)
        gate.wait(30)  # a chunk of work the fence cannot interrupt
        threads.remove(ctx.attempt)
        return "stopped" if ctx.cancelled else "done"

    flaky = FlakyStore(pg_store)
    async with (
        running_scheduler(pg_store, redis_bus, reap_grace_s=0.0),
        running_worker(app, flaky, redis_bus, lease_s=LEASE_S, heartbeat_s=0.3) as worker,
    ):
        instance = await Dispatcher(pg_store, redis_bus).trigger("chunk")

        async def processing() -> bool:
            return (await pg_store.get_instance(instance.id)).state is S.PROCESSING

        await wait_for(processing, what="the claim")
        flaky.down = {"heartbeat"}  # its lease is not renewed...
        await wait_for(lambda: _fenced(worker, instance.id), what="the fence")
        flaky.down = set()  # ... until the store is back, before the lease ends
        await asyncio.sleep(LEASE_S + 1.0)  # past the end of the lease it had when fenced
        current = await pg_store.get_instance(instance.id)
        assert threads == [1]  # its code still runs...
        assert current.state is S.PROCESSING and current.attempt == 1  # ... and holds the lease
        assert current.lease_expires_at is not None
        assert current.lease_expires_at > await pg_store.now()
        gate.set()
        await wait_for(lambda: _gone(worker), what="the attempt to end")
    moves = [(t.from_state, t.to_state, t.reason) for t in await pg_store.transitions(instance.id)]
    assert (S.PROCESSING, S.ENQUEUED, EndReason.LEASE_EXPIRED) not in moves  # never reaped


async def _gone(worker: Worker) -> bool:
    return not worker.running


@pytest.mark.parametrize("stops", ["returns", "raises"])
async def test_a_fenced_sync_job_that_stops_early_is_released_not_recorded(
    stops: str, store: SqlStore, redis_bus: Bus
) -> None:
    """A sync job that checks ``ctx.cancelled`` (as the docs say) stops when the fence asks it
    to: what it returns (a partial result) or raises is the stop's doing. Its attempt is
    released and run again; it was recorded Succeeded with the partial result, or Failed
    (Terminated here: no retry left)."""
    app = App("fenced-sync")
    noticed: list[object] = []

    @app.triggered(retries=0)
    def steps(ctx: JobContext) -> dict[str, int]:
        for step in range(600):
            if ctx.attempt > 1:
                break  # the attempt after the release runs to its end at once
            if ctx.cancelled:
                noticed.append(ctx.cancellation.reason)
                if stops == "raises":
                    raise RuntimeError(f"stopped at step {step}")
                return {"steps": step}
            ctx.cancellation.wait_sync(0.05)
        return {"steps": 600}

    flaky = FlakyStore(store)
    async with running_worker(app, flaky, redis_bus, lease_s=LEASE_S, heartbeat_s=0.3):
        instance = await Dispatcher(store, redis_bus).trigger("steps")

        async def processing() -> bool:
            return (await store.get_instance(instance.id)).state is S.PROCESSING

        await wait_for(processing, what="the claim")
        flaky.down = {"heartbeat"}

        async def stopping() -> bool:
            return bool(noticed)

        await wait_for(stopping, what="the fence, and the job to notice it")
        flaky.down = set()
        [done] = await settled(store, [instance.id], timeout_s=20)
    assert noticed == [StopReason.LEASE_LOST]
    moves = [(t.from_state, t.to_state, t.reason) for t in await store.transitions(instance.id)]
    assert (S.PROCESSING, S.ENQUEUED, StopReason.LEASE_LOST) in moves
    assert done.state is S.SUCCEEDED and done.result == {"steps": 600}, moves
    assert done.attempt == 2 and done.retries_used == 0


async def test_a_checkpoint_not_saved_that_ends_a_sync_job_releases_it(
    store: SqlStore, redis_bus: Bus
) -> None:
    """The store stays away a little longer than the lease: the job's checkpoint gives up
    (``CheckpointNotSavedError``) just before the fence, and the job, which does not catch
    it, ends on it. That is the fence's stop: released and run again from its last saved
    checkpoint, not Failed (Terminated here, no retry left)."""
    app = App("checkpointing")

    @app.triggered(retries=0)
    def chunks(ctx: JobContext) -> int:
        done: int = (ctx.last_checkpoint or {}).get("chunks", 0)
        while done < 10 and not ctx.cancelled:
            done += 1
            ctx.cancellation.wait_sync(0.1 if ctx.attempt > 1 else 0.3)  # a chunk of work
            ctx.checkpoint_sync({"chunks": done})
        return done

    flaky = FlakyStore(store)
    async with running_worker(app, flaky, redis_bus, lease_s=LEASE_S, heartbeat_s=0.3):
        instance = await Dispatcher(store, redis_bus).trigger("chunks")

        async def checkpointed() -> bool:
            return (await store.get_instance(instance.id)).checkpoint is not None

        async def attempt_over() -> bool:
            now = await store.get_instance(instance.id)
            return now.state is not S.PROCESSING or now.attempt > 1

        await wait_for(checkpointed, what="a first checkpoint")
        flaky.down = {"save_checkpoint", "heartbeat"}  # its writes fail, not the release
        await wait_for(attempt_over, what="the first attempt to end")
        flaky.down = set()
        [done] = await settled(store, [instance.id], timeout_s=20)
    moves = [(t.from_state, t.to_state, t.reason) for t in await store.transitions(instance.id)]
    assert (S.PROCESSING, S.ENQUEUED, StopReason.LEASE_LOST) in moves
    assert done.state is S.SUCCEEDED and done.result == 10, moves
    assert done.attempt == 2 and done.retries_used == 0


async def test_a_job_the_fence_stops_on_every_attempt_is_terminated_once_exhausted(
    store: SqlStore, redis_bus: Bus
) -> None:
    """An async job that blocks its event loop for most of the lease: no heartbeat renews it in
    time, so the fence stops every attempt. Each release counts an unexpected retry, as the
    reaper's does: Terminated once they are used up (it was released and run for ever)."""
    app = App("blocks-loop")

    @app.triggered(max_unexpected_retries=1, retries=0)
    async def blocks(ctx: JobContext) -> str:
        time.sleep(LEASE_S * 0.85)  # noqa: ASYNC251 (blocking the loop is the point)
        await asyncio.sleep(LEASE_S)
        return "done"

    async with running_worker(app, store, redis_bus, lease_s=LEASE_S, heartbeat_s=0.5):
        instance = await Dispatcher(store, redis_bus).trigger("blocks")
        [done] = await settled(store, [instance.id], timeout_s=30)
    moves = [(t.from_state, t.to_state, t.reason) for t in await store.transitions(instance.id)]
    assert done.state is S.TERMINATED and done.reason == EndReason.EXHAUSTED, moves
    assert done.attempt == 2 and done.unexpected_retries_used == 1 and done.retries_used == 0
    assert moves.count((S.PROCESSING, S.ENQUEUED, StopReason.LEASE_LOST)) == 1


async def test_a_stop_for_the_lease_that_cancels_the_code_is_counted_as_the_fences(
    store: SqlStore,
) -> None:
    """An isolated child that stopped itself at the fence (its worker frozen, or its loop
    blocked, so the worker's own fence did not run) ends its attempt with the lease's stop:
    the attempt is marked fenced, so its release counts an unexpected retry and says "lease
    lost", as the fence's does (it was released as a shutdown: uncounted)."""
    await define(store, "job")
    [instance] = await enqueue(store, "job")
    [claim] = (await store.claim([instance.id], "w1", 30, ["job"])).claimed
    ctx = JobContext(
        instance_id=instance.id, job_key="job", attempt=1, scheduled_at=None, worker_id="w1"
    )
    attempt = Attempt(claim, ctx)
    ctx.cancellation.set(StopReason.LEASE_LOST)
    with pytest.raises(asyncio.CancelledError):
        _raised(attempt, asyncio.CancelledError())
    assert attempt.fenced and ending(attempt, None, broken=False) is Ending.RELEASE
    # A stop of the worker's own (its drain) stays a shutdown's release.
    drained = Attempt(claim, JobContext(instance.id, "job", 1, None, "w1"))
    drained.ctx.cancellation.set(StopReason.SHUTDOWN)
    with pytest.raises(asyncio.CancelledError):
        _raised(drained, asyncio.CancelledError())
    assert not drained.fenced
