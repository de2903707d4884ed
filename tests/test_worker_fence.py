"""Attempts the worker's fence stopped (it could not renew their lease in time): while their
code still runs their lease is kept if the store comes back, and once it has stopped what the
stop made the job do is not its outcome. Real Postgres (and SQLite) and Redis; the outage is
injected into the worker's store calls (see FlakyStore)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from uuid import UUID

import pytest

from jobplane import App, JobContext
from jobplane.bus.abc import Bus
from jobplane.dispatch import Dispatcher
from jobplane.domain.reasons import EndReason
from jobplane.domain.states import InstanceState as S
from jobplane.store.sql import SqlStore
from jobplane_worker.worker import Worker
from tests.scheduler_helpers import running_scheduler
from tests.worker_helpers import FlakyStore, running_worker, wait_for

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
