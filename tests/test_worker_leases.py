"""An attempt whose lease is lost, or answered for, while the worker still handles it: the reaper
releases an instance whose sync code still runs here (this worker frozen or cut off past the
lease, or a job blocking its loop) and this same worker claims it again; a runaway whose lease
was lost; a heartbeat's answer that comes after the attempt's code returned. Each attempt's end
touches only that attempt. Postgres and Redis; the reaper is called by the test."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Collection, Iterator, Mapping
from uuid import UUID

import pytest
from sqlalchemy import update

from jobplane import App, JobContext
from jobplane.bus.abc import Bus
from jobplane.dispatch import Dispatcher
from jobplane.domain.models import Instance
from jobplane.domain.states import InstanceState as S
from jobplane.store.sql import SqlStore
from jobplane.store.tables import job_instances
from jobplane_worker.worker import Worker
from tests.worker_helpers import FAST, FlakyStore, running_worker, settled, wait_for

pytestmark = pytest.mark.timeout(90)


async def _reap(store: SqlStore, instance_id: UUID) -> Instance:
    """What the scheduler's reaper does once the attempt's lease has expired: release the
    instance (Enqueued, an unexpected retry counted). Tried again if a heartbeat renewed the
    lease between the expiry and the release."""
    lease = await store.acquire_leadership(0, "test-reaper", 30)
    assert lease is not None
    for _ in range(50):
        async with store.engine.begin() as conn:
            await conn.execute(
                update(job_instances)
                .where(job_instances.c.id == instance_id)
                .values(lease_expires_at=job_instances.c.created_at)
            )
        released = [i for i in await store.release_expired(lease) if i.id == instance_id]
        if released:
            return released[0]
    raise AssertionError("the reaper never found the lease expired")


def _finished(worker: Worker, job: str, outcome: str) -> float:
    labels = {"job": job, "outcome": outcome}
    name = "jobplane_worker_attempts_finished_total"
    return float(worker.metrics.registry.get_sample_value(name, labels) or 0.0)


@pytest.fixture
def gates() -> Iterator[dict[int, threading.Event]]:
    """Events the sync jobs of a test wait on; all set at its end, so no thread outlives it."""
    made: dict[int, threading.Event] = {n: threading.Event() for n in range(1, 4)}
    yield made
    for gate in made.values():
        gate.set()


async def test_an_instance_claimed_again_while_its_earlier_attempt_runs_keeps_its_new_lease(
    pg_store: SqlStore, redis_bus: Bus, gates: dict[int, threading.Event]
) -> None:
    """The earlier attempt's end (its code returns) forgets only that attempt: the new one is
    still heartbeated and fenced, so its lease never runs out while it runs."""
    app = App("reclaimed")
    started: list[int] = []
    ended: list[int] = []

    @app.triggered(timeout_s=60)
    def blocks(ctx: JobContext) -> int:
        started.append(ctx.attempt)
        gates[ctx.attempt].wait(60)  # a sync job: nothing stops it
        ended.append(ctx.attempt)
        return ctx.attempt

    async def has_started(attempt: int) -> bool:
        return attempt in started

    async def has_ended(attempt: int) -> bool:
        return attempt in ended

    async with running_worker(app, pg_store, redis_bus, concurrency=4) as worker:
        dispatcher = Dispatcher(pg_store, redis_bus)
        instance = await dispatcher.trigger("blocks")
        await wait_for(lambda: has_started(1), what="attempt 1")
        await dispatcher.publish([await _reap(pg_store, instance.id)], force=True)
        await wait_for(lambda: has_started(2), what="attempt 2, on this same worker")
        assert 1 not in ended  # attempt 1's code still runs...
        gates[1].set()  # ... and returns now
        await wait_for(lambda: has_ended(1), what="attempt 1's code to return")
        # Well past a lease (2 s): attempt 2's has been renewed all along.
        await asyncio.sleep(FAST["lease_s"] + 1.0)
        current = await pg_store.get_instance(instance.id)
        assert current.state is S.PROCESSING and current.attempt == 2
        assert current.lease_expires_at is not None
        assert current.lease_expires_at > await pg_store.now()
        attempt = worker.attempt_of(instance.id)
        assert attempt is not None and attempt.claim.token == current.claim_token
        assert not (attempt.lease_lost or attempt.fenced)
        gates[2].set()
        [done] = await settled(pg_store, [instance.id])
        assert _finished(worker, "blocks", "lease_lost") == 1
    assert done.state is S.SUCCEEDED and done.result == 2 and done.attempt == 2
    assert done.unexpected_retries_used == 1  # the one release by the (test's) reaper
    assert started == [1, 2]


async def test_a_runaway_whose_lease_was_lost_lets_its_worker_slot_go_when_its_thread_returns(
    pg_store: SqlStore, redis_bus: Bus, gates: dict[int, threading.Event]
) -> None:
    """Its outcome is not recorded (another worker may own the instance), so it holds no job
    slot: the runaway is let go as soon as its thread returns, and the worker stops."""
    app = App("lost-runaway")

    @app.triggered(timeout_s=2.0)
    def stubborn() -> str:
        gates[1].wait(60)  # ignores its timeout, and the lost lease's signal
        return "late"

    @app.triggered()
    async def other() -> str:
        return "ok"

    async def lease_lost(worker: Worker) -> bool:
        return any(a.lease_lost for a in worker.running.values())

    async def runaways(worker: Worker, n: int) -> bool:
        return worker.runaway_count == n

    async with running_worker(app, pg_store, redis_bus, concurrency=1) as worker:
        dispatcher = Dispatcher(pg_store, redis_bus)
        instance = await dispatcher.trigger("stubborn")

        async def processing() -> bool:
            return (await pg_store.get_instance(instance.id)).state is S.PROCESSING

        await wait_for(processing, what="the claim")
        await _reap(pg_store, instance.id)  # not published again: it stays Enqueued
        await wait_for(lambda: lease_lost(worker), what="the heartbeat to see the lease lost")
        await wait_for(lambda: runaways(worker, 1), what="the timeout: a runaway")
        gates[1].set()
        await wait_for(lambda: runaways(worker, 0), timeout_s=5, what="the runaway to be let go")
        later = await dispatcher.trigger("other")  # concurrency 1: the slot is free again
        [done] = await settled(pg_store, [later.id], timeout_s=10)
        assert _finished(worker, "stubborn", "lease_lost") == 1
    assert done.state is S.SUCCEEDED
    left = await pg_store.get_instance(instance.id)
    assert left.state is S.ENQUEUED and left.unexpected_retries_used == 1  # nothing written


class AnswerAfterReturn(FlakyStore):
    """The store; the first renewal of a lease is held until the attempt's code has returned
    and the worker writes its last progress (a heartbeat of its lease alone); that write is
    held until the renewal's answer has been handled."""

    def __init__(self, store: SqlStore) -> None:
        super().__init__(store)
        self.renewal_out = asyncio.Event()
        self.flushing = asyncio.Event()
        self.answered = asyncio.Event()

    async def heartbeat(
        self,
        leases: Collection[tuple[UUID, int]],
        lease_s: float,
        progress: Mapping[UUID, tuple[float, str | None]] | None = None,
    ) -> dict[UUID, bool]:
        if leases and not self.renewal_out.is_set():
            self.renewal_out.set()
            await self.flushing.wait()
            kept = await self.store.heartbeat(leases, lease_s, progress)
            # Handled by the caller as soon as this returns; then the held write goes on.
            asyncio.get_running_loop().call_soon(self.answered.set)
            return kept
        if leases and not self.flushing.is_set():
            self.flushing.set()
            await self.answered.wait()
        return await self.store.heartbeat(leases, lease_s, progress)


async def test_a_cancel_the_heartbeat_reads_after_the_job_returned_leaves_its_outcome_alone(
    pg_store: SqlStore, redis_bus: Bus
) -> None:
    """A heartbeat sent while the job ran answers "cancel requested" once it has returned and
    its outcome is being recorded: the outcome is recorded all the same (the signal is for a
    running attempt; cancelled there, the recording was dropped and the instance left to the
    reaper)."""
    app = App("late-answer")
    store = AnswerAfterReturn(pg_store)
    cancel_stored = asyncio.Event()

    @app.triggered()
    async def reports(ctx: JobContext) -> str:
        ctx.progress(0.5, "half")  # written by the next heartbeat, or before the outcome
        await store.renewal_out.wait()
        await cancel_stored.wait()
        return "done"

    async with running_worker(app, store, redis_bus) as worker:
        instance = await Dispatcher(pg_store, redis_bus).trigger("reports")
        await asyncio.wait_for(store.renewal_out.wait(), timeout=20)
        # Stored only (no event to the worker): the held renewal reads it.
        await pg_store.request_cancel(instance.id, "test")
        cancel_stored.set()
        [done] = await settled(pg_store, [instance.id], timeout_s=10)
        assert store.answered.is_set()
        assert _finished(worker, "reports", "succeeded") == 1
    assert done.state is S.SUCCEEDED and done.result == "done"
    assert done.progress == 0.5 and done.progress_message == "half"
    assert done.unexpected_retries_used == 0
