"""A sync job that ignores its timeout, on Postgres and Redis: its attempt ends Failed on time,
while the job's slot and the worker's thread stay held until its code really returns, and are
given back then whatever its code ends with and whatever the store does meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from pathlib import Path
from uuid import UUID

import pytest
from pydantic import BaseModel

from jobplane import App, JobContext
from jobplane.bus.abc import Bus
from jobplane.dispatch import Dispatcher
from jobplane.domain.states import InstanceState as S
from jobplane.store.sql import SqlStore
from jobplane_worker.attempt import ASYNC_STOP_S
from jobplane_worker.worker import Worker
from tests.apps.basic import app
from tests.store_helpers import slots_used
from tests.worker_helpers import FlakyStore, running_worker, settled, wait_for

pytestmark = pytest.mark.timeout(120)

TIMEOUT_S = 1.0  # runaway_retried's timeout
GRACE_S = 0.5
MARGIN_S = 1.5


async def test_a_sync_runaway_fails_on_time_and_its_retry_waits_for_its_thread(
    pg_store: SqlStore, redis_bus: Bus, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    log = tmp_path / "gate.log"
    loop = asyncio.get_running_loop()
    async with running_worker(app, pg_store, redis_bus, timeout_grace_s=GRACE_S) as worker:
        instance = await Dispatcher(pg_store, redis_bus).trigger(
            "runaway_retried", {"path": str(gate)}
        )
        await wait_for(lambda: _has_line(log, "start 1"), what="the first attempt to start")
        started = loop.time()
        await wait_for(lambda: _failed(pg_store, instance.id), what="the timeout to be recorded")
        assert loop.time() - started < TIMEOUT_S + GRACE_S + MARGIN_S
        assert not await _has_line(log, "end 1")  # recorded while its code still runs

        # The retry finds the job's only slot held by that code: it waits (on_limit=wait),
        # and so does the worker's thread, which counts against the worker's own limit.
        await asyncio.sleep(1.0)
        waiting = await pg_store.get_instance(instance.id)
        assert waiting.state is S.ENQUEUED and waiting.attempt == 1 and waiting.retries_used == 1
        assert await slots_used(pg_store, "runaway_retried") == 1
        assert worker.runaway_count == 1
        assert not await _has_line(log, "start 2")

        gate.touch()  # the runaway's code returns at last
        [done] = await settled(pg_store, [instance.id], timeout_s=30)
        await wait_for(lambda: _runaways_gone(worker), what="the runaway to be let go")
        # The heartbeat left the recorded attempt alone: no lease was seen lost.
        assert _sample(worker, "jobplane_worker_lease_lost_writes_total", write="heartbeat") == 0
        assert _sample(worker, "jobplane_worker_runaways_total", job="runaway_retried") == 1
    assert done.state is S.SUCCEEDED and done.attempt == 2 and done.retries_used == 1
    lines = await asyncio.to_thread(log.read_text)
    assert [line.split()[:2] for line in lines.splitlines()] == [
        ["start", "1"],
        ["end", "1"],
        ["start", "2"],
    ]
    assert "cancelled=True" in lines  # it was told, and ignored it
    history = await pg_store.transitions(instance.id)
    steps = [(t.from_state, t.to_state, t.reason) for t in history]
    assert steps == [
        (None, S.ENQUEUED, None),
        (S.ENQUEUED, S.PROCESSING, None),
        (S.PROCESSING, S.FAILED, "timeout"),
        (S.FAILED, S.ENQUEUED, "retry 1 of 1"),
        (S.ENQUEUED, S.PROCESSING, None),
        (S.PROCESSING, S.SUCCEEDED, None),
    ]
    failed_at, retried_at = history[2].at, history[4].at
    assert (retried_at - failed_at).total_seconds() >= 1.0  # it waited for the thread
    assert await slots_used(pg_store, "runaway_retried") == 0


async def _has_line(path: Path, prefix: str) -> bool:
    def read() -> bool:
        return path.exists() and any(
            line.startswith(prefix) for line in path.read_text().splitlines()
        )

    return await asyncio.to_thread(read)


async def _failed(store: SqlStore, instance_id: UUID) -> bool:
    return any(t.to_state is S.FAILED for t in await store.transitions(instance_id))


async def _runaways_gone(worker: Worker) -> bool:
    return worker.runaway_count == 0


def _sample(worker: Worker, name: str, **labels: str) -> float:
    return float(worker.metrics.registry.get_sample_value(name, labels) or 0.0)


class Arg(BaseModel):
    n: int


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str for you")


async def test_a_runaway_that_ends_raising_what_cannot_print_gives_its_slot_back(
    pg_store: SqlStore, redis_bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    app = App("unprintable")
    gate = threading.Event()

    @app.triggered(timeout_s=0.5, max_concurrency=1)
    def stubborn() -> None:
        gate.wait(60)  # ignores its timeout
        raise Unprintable

    caplog.set_level(logging.WARNING, logger="jobplane_worker.worker")
    try:
        async with running_worker(app, pg_store, redis_bus, timeout_grace_s=0.2):
            instance = await Dispatcher(pg_store, redis_bus).trigger("stubborn")
            [failed] = await settled(pg_store, [instance.id])
            assert failed.state is S.TERMINATED and failed.reason == "no attempts left"
            assert await slots_used(pg_store, "stubborn") == 1  # its code still runs
            gate.set()
            await wait_for(lambda: _slot_free(pg_store, "stubborn"), what="the slot to come back")
    finally:
        gate.set()
    [returned] = [r for r in caplog.records if _action(r) == "worker.runaway_returned"]
    assert "raised Unprintable: <Unprintable: str() failed>" in returned.getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_store_outage_as_a_runaway_lets_go_only_delays_the_instance_parked_for_it(
    pg_store: SqlStore, redis_bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    """Republishing the instance parked for the runaway's slot (``on_limit="wait"``) meets an
    outage: retried as the recorder's republishing is, never the end of the runaway's watcher."""
    app = App("parked")
    gate = threading.Event()

    @app.triggered(timeout_s=0.5, max_concurrency=1, on_limit="wait")
    def one_at_a_time(args: Arg) -> int:
        if args.n == 0:
            gate.wait(60)  # ignores its timeout
        return args.n

    flaky = FlakyStore(pg_store)
    caplog.set_level(logging.WARNING)
    try:
        async with running_worker(app, flaky, redis_bus, timeout_grace_s=0.2) as worker:
            dispatcher = Dispatcher(pg_store, redis_bus)
            runaway = await dispatcher.trigger("one_at_a_time", {"n": 0})
            await settled(pg_store, [runaway.id])
            parked = await dispatcher.trigger("one_at_a_time", {"n": 1})

            async def is_parked() -> bool:
                found = await pg_store.get_instance(parked.id)
                return found.state is S.ENQUEUED and found.published_at is None

            await wait_for(is_parked, what="the claim to park the second instance")
            flaky.fail_next["republish_waiting"] = 2  # the store is away as the thread returns
            gate.set()
            [done] = await settled(pg_store, [parked.id], timeout_s=15)
            await wait_for(lambda: _runaways_gone(worker), what="the watcher to end")
            assert not worker.runaways.watchers()
    finally:
        gate.set()
    assert done.state is S.SUCCEEDED and done.result == 1
    assert len(flaky.refusals("republish_waiting")) == 2
    assert await slots_used(pg_store, "one_at_a_time") == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def _slot_free(store: SqlStore, key: str) -> bool:
    return await slots_used(store, key) == 0


def _action(record: logging.LogRecord) -> str:
    return str(getattr(record, "action", ""))


async def test_an_async_job_that_swallows_its_cancellation_fails_on_time(
    pg_store: SqlStore, redis_bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    """An async job that catches every CancelledError and goes on: it ran until its code
    returned, however long after its timeout, Processing all along and holding its slot,
    and nothing was logged. Its attempt now ends Failed on time and the task runs on as a
    runaway, holding the job's slot and a worker slot until it returns, as a sync one does."""
    app = App("swallower")
    release = asyncio.Event()

    @app.triggered(timeout_s=0.5, max_concurrency=1)
    async def swallows() -> str:
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):  # ignores its cancellation
                await asyncio.sleep(0.05)
        return "late"

    caplog.set_level(logging.WARNING, logger="jobplane_worker.worker")
    loop = asyncio.get_running_loop()
    try:
        async with running_worker(app, pg_store, redis_bus, timeout_grace_s=0.2) as worker:
            started = loop.time()
            instance = await Dispatcher(pg_store, redis_bus).trigger("swallows")
            [failed] = await settled(pg_store, [instance.id])
            assert loop.time() - started < 0.5 + 0.2 + ASYNC_STOP_S + MARGIN_S
            assert failed.state is S.TERMINATED and failed.error is not None
            assert failed.error.type == "TimeoutError"
            assert await slots_used(pg_store, "swallows") == 1  # its code still runs
            assert worker.runaway_count == 1
            assert _sample(worker, "jobplane_worker_runaways_total", job="swallows") == 1
            release.set()
            await wait_for(lambda: _slot_free(pg_store, "swallows"), what="the slot to come back")
            await wait_for(lambda: _runaways_gone(worker), what="the runaway to be let go")
    finally:
        release.set()
    actions = [_action(r) for r in caplog.records]
    assert "worker.runaway" in actions
    [returned] = [r for r in caplog.records if _action(r) == "worker.runaway_returned"]
    assert "returned at last" in returned.getMessage()


async def test_a_cancellation_after_an_async_timeout_is_the_timeout(
    pg_store: SqlStore, redis_bus: Bus
) -> None:
    """Once an async job's timeout has signalled, a CancelledError of its own (it cancels
    the work it awaited, on the signal) is the timeout's: taken for a stop of the worker's,
    the attempt was released, timed out again, and again (13 runs in 4 s). Recorded Failed
    (timeout) once, Terminated with no retry left."""
    app = App("own_cancel")
    runs: list[int] = []

    @app.triggered(timeout_s=0.3)
    async def cancels_its_work(ctx: JobContext) -> str:
        runs.append(ctx.attempt)
        work = asyncio.create_task(asyncio.sleep(10))
        signalled = asyncio.create_task(ctx.cancellation.wait())
        await asyncio.wait({work, signalled}, return_when=asyncio.FIRST_COMPLETED)
        work.cancel()
        await work  # raises the job's own CancelledError
        return "unreachable"

    async with running_worker(app, pg_store, redis_bus, timeout_grace_s=0.2):
        instance = await Dispatcher(pg_store, redis_bus).trigger("cancels_its_work")
        [ended] = await settled(pg_store, [instance.id])
        await asyncio.sleep(1.0)  # (a release would have run it again by now)
    assert ended.state is S.TERMINATED and ended.error is not None
    assert ended.error.type == "TimeoutError" and runs == [1]


async def test_a_drain_during_an_async_timeout_grace_records_the_timeout(
    pg_store: SqlStore, redis_bus: Bus
) -> None:
    """The worker stops while an async job is in its timeout's grace (signalled, not yet
    cancelled): the attempt timed out, and is recorded so, not released to run again."""
    app = App("drained")
    started = asyncio.Event()

    @app.triggered(timeout_s=0.3)
    async def slow(ctx: JobContext) -> None:
        started.set()
        await asyncio.sleep(30)  # ignores the signal, but not a cancel

    async with running_worker(app, pg_store, redis_bus, timeout_grace_s=5, grace_s=0.1):
        instance = await Dispatcher(pg_store, redis_bus).trigger("slow")
        await asyncio.wait_for(started.wait(), 10)
        await asyncio.sleep(0.6)  # signalled at 0.3 s; cancelled only at 5.3 s
    ended = await pg_store.get_instance(instance.id)
    assert ended.state is S.TERMINATED and ended.error is not None
    assert ended.error.type == "TimeoutError" and ended.attempt == 1
