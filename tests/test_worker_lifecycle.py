"""A worker's stop while a read is in flight, what a job sees as ``scheduled_at``, a retry with
a real backoff delay, the option-drift warning, and a worker's failure while its jobs run.
Postgres and Redis."""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest

from jobplane import App, JobContext
from jobplane.bus.abc import Bus
from jobplane.dispatch import Dispatcher
from jobplane.domain.models import InstanceSource, NewInstance
from jobplane.domain.options import JobOptions
from jobplane.domain.states import InstanceState as S
from jobplane.errors import StoreRefusedError, WorkerFailedError
from jobplane.store.abc import WorkerStore
from jobplane.store.sql import SqlStore
from jobplane_worker.settings import WorkerSettings
from jobplane_worker.worker import Worker
from tests.scheduler_helpers import running_scheduler
from tests.worker_helpers import FAST, StopDuringReadBus, running_worker, settled, wait_for

pytestmark = pytest.mark.timeout(60)


def _echo_app() -> App:
    app = App("stopping")

    @app.triggered()
    async def note(ctx: JobContext) -> str:
        return ctx.worker_id

    return app


async def test_a_batch_read_after_the_stop_is_not_claimed_and_nothing_is_lost(
    pg_store: SqlStore, redis_bus: Bus
) -> None:
    app = _echo_app()
    stop = asyncio.Event()
    stopping_bus = StopDuringReadBus(redis_bus, stop)
    settings = WorkerSettings(worker_id=f"w-{uuid.uuid4().hex[:8]}", **FAST)
    first = asyncio.create_task(Worker(app, pg_store, stopping_bus, settings).run(stop))

    async def registered() -> bool:
        return len(await pg_store.list_workers()) == 1

    await wait_for(registered, task=first, what="the first worker")
    instance = await Dispatcher(pg_store, redis_bus).trigger("note")
    await asyncio.wait_for(first, timeout=30)  # the read returned it, then the stop came
    assert [d.envelope.instance_id for d in stopping_bus.returned] == [instance.id]
    left = await pg_store.get_instance(instance.id)
    assert left.state is S.ENQUEUED and left.attempt == 0
    assert [t.to_state for t in await pg_store.transitions(instance.id)] == [S.ENQUEUED]

    # Another worker never reclaims the pending entry here (reclaim_idle_s is long): it is the
    # scheduler's sweep that republishes the still-Enqueued instance.
    async with (
        running_scheduler(pg_store, redis_bus),
        running_worker(app, pg_store, redis_bus, reclaim_idle_s=600) as second,
    ):
        [done] = await settled(pg_store, [instance.id])
    assert done.state is S.SUCCEEDED and done.result == second.id and done.attempt == 1
    assert left.published_at is not None and done.published_at is not None
    assert done.published_at > left.published_at  # republished


async def test_scheduled_at_is_when_the_instance_was_due(
    pg_store: SqlStore, redis_bus: Bus
) -> None:
    app = App("due")

    @app.triggered(max_concurrency=5)
    async def when(ctx: JobContext) -> str | None:
        return ctx.scheduled_at.isoformat() if ctx.scheduled_at else None

    dispatcher = Dispatcher(pg_store, redis_bus)
    async with running_scheduler(pg_store, redis_bus), running_worker(app, pg_store, redis_bus):
        now_ = await dispatcher.trigger("when")
        later = await dispatcher.trigger("when", delay=timedelta(seconds=0.5))
        occurrence = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)
        [fired] = await pg_store.create_instances(
            [NewInstance(job_key="when", source=InstanceSource.CRON, scheduled_at=occurrence)]
        )
        await dispatcher.publish([fired])
        done = await settled(pg_store, [now_.id, later.id, fired.id])
    assert {i.state for i in done} == {S.SUCCEEDED}
    by_id = {i.id: datetime.fromisoformat(str(i.result)) for i in done}
    assert by_id[now_.id] == now_.created_at
    assert later.run_at is not None and by_id[later.id] == later.run_at
    assert by_id[fired.id] == occurrence


async def test_a_retry_waits_its_backoff_delay_end_to_end(
    pg_store: SqlStore, redis_bus: Bus
) -> None:
    app = App("backoff")
    delay_s = 1.0

    @app.triggered(retries=1, backoff={"kind": "fixed", "delay_s": delay_s, "jitter": False})
    async def flaky(ctx: JobContext) -> int:
        if ctx.attempt == 1:
            raise RuntimeError("first attempt fails")
        return ctx.attempt

    async with running_scheduler(pg_store, redis_bus), running_worker(app, pg_store, redis_bus):
        instance = await Dispatcher(pg_store, redis_bus).trigger("flaky")
        [done] = await settled(pg_store, [instance.id])
    assert done.state is S.SUCCEEDED and done.result == 2 and done.retries_used == 1
    history = await pg_store.transitions(done.id)
    steps = [(t.from_state, t.to_state) for t in history]
    assert steps == [
        (None, S.ENQUEUED),
        (S.ENQUEUED, S.PROCESSING),
        (S.PROCESSING, S.FAILED),
        (S.FAILED, S.SCHEDULED),
        (S.SCHEDULED, S.ENQUEUED),
        (S.ENQUEUED, S.PROCESSING),
        (S.PROCESSING, S.SUCCEEDED),
    ]
    claimed_at, failed_at, promoted_at = history[1].at, history[2].at, history[4].at
    assert done.run_at is not None
    # The retry was due the delay after the failure: counted from the start of the failure's
    # transaction (the database's now()), which is after the claim and no later than the failure
    # row (its clock_timestamp()). A fixed tolerance here measured the statement's duration,
    # which a loaded machine stretches past any small bound.
    due_from = done.run_at - timedelta(seconds=delay_s)
    assert claimed_at <= due_from <= failed_at
    # ... was not promoted before it was due, and the sweep (every 0.2 s) promoted it soon after.
    assert promoted_at >= done.run_at
    assert (promoted_at - done.run_at).total_seconds() < 2.0


async def test_option_drift_on_registration_is_logged(
    pg_store: SqlStore, redis_bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    app = App("drift")

    @app.triggered(retries=1, timeout_s=10)
    async def drifting() -> None: ...

    # An operator edited the stored options since the code was written.
    stored = JobOptions.parse(key="drifting", kind="triggered", retries=4, timeout_s=10)
    await pg_store.register_definition(stored, None, "ops")
    with caplog.at_level(logging.WARNING, logger="jobplane_worker.worker"):
        async with running_worker(app, pg_store, redis_bus):
            pass
    [record] = [r for r in caplog.records if getattr(r, "action", None) == "worker.options_drift"]
    assert record.levelno == logging.WARNING and getattr(record, "job_key", None) == "drifting"
    assert "retries" in record.getMessage() and "timeout_s" not in record.getMessage()
    assert (await pg_store.get_definition("drifting")).options.retries == 4  # stored ones win


class _RefusingHeartbeat:
    """The real store, until ``refuse``: then its worker heartbeat is refused as no outage is
    (a bug's error), which kills the worker's heartbeat task, and so the worker."""

    def __init__(self, store: SqlStore) -> None:
        self.store = store
        self.refuse = False

    def __getattr__(self, name: str) -> Any:
        real = getattr(self.store, name)
        if name != "worker_heartbeat":
            return real

        async def call(*args: Any, **kwargs: Any) -> Any:
            if self.refuse:
                raise StoreRefusedError("refused (injected)", "XX000")
            return await real(*args, **kwargs)

        return call


async def test_a_failing_worker_leaves_its_running_jobs_to_their_leases(
    pg_store: SqlStore, redis_bus: Bus
) -> None:
    """A worker that fails while job code runs in it cannot stop that code (a pool thread),
    and its process lives on until the code returns. Marked stopped, its rows and slots went
    to the leader's dead-worker sweep at once, and another worker ran the job beside it. It
    now stays unmarked (its attempts end with their leases, after the process ends) and the
    role is told to exit at once."""
    gate = threading.Event()
    app = App("failing")

    @app.triggered()
    def blocks() -> None:
        gate.wait(30)

    store = _RefusingHeartbeat(pg_store)
    settings = WorkerSettings(worker_id=f"w-{uuid.uuid4().hex[:8]}", **FAST)
    worker = Worker(app, cast(WorkerStore, store), redis_bus, settings)
    run = asyncio.create_task(worker.run(asyncio.Event()))
    try:

        async def registered() -> bool:
            return any(w.id == worker.id for w in await pg_store.list_workers())

        await wait_for(registered, what="the worker's registration", task=run)
        instance = await Dispatcher(pg_store, redis_bus).trigger("blocks")

        async def processing() -> bool:
            return (await pg_store.get_instance(instance.id)).state is S.PROCESSING

        await wait_for(processing, what="the job to start", task=run)
        store.refuse = True
        with pytest.raises(WorkerFailedError):
            await asyncio.wait_for(run, 30)
        [row] = [w for w in await pg_store.list_workers() if w.id == worker.id]
        assert row.stopped_at is None
        assert (await pg_store.get_instance(instance.id)).state is S.PROCESSING
    finally:
        gate.set()
        run.cancel()
