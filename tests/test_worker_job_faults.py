"""Whatever a job raises is its outcome: a CancelledError of its own, an exception that cannot
even say what it is, a ``BaseException`` of a library's. Recorded Failed and retried as any
failure, never taken for the worker's stop, never left to its lease. Postgres and Redis."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest

from jobplane import App, JobContext
from jobplane.bus.abc import Bus
from jobplane.dispatch import Dispatcher
from jobplane.domain.states import InstanceState as S
from jobplane.store.sql import SqlStore
from jobplane_worker.job_errors import MESSAGE_MAX, TRACEBACK_MAX
from tests.worker_helpers import running_worker, settled, wait_for

pytestmark = pytest.mark.timeout(60)

app = App("job-faults")


@app.triggered(retries=1, backoff={"kind": "none"})
async def awaits_a_cancelled_future() -> None:
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()
    loop.call_soon(future.cancel)  # a library cancels a request it handed out
    await future


@app.triggered(retries=1, backoff={"kind": "none"})
def waits_for_a_cancelled_future() -> None:
    future: concurrent.futures.Future[None] = concurrent.futures.Future()
    future.cancel()
    future.result()  # concurrent.futures.CancelledError: asyncio.CancelledError in the worker


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str for you")


class Abort(BaseException):
    """A library's own control flow (gevent's GreenletExit, trio's Cancelled): no Exception."""


@app.triggered()
async def raises_unprintable_async() -> None:
    raise Unprintable


@app.triggered()
def raises_unprintable_sync() -> None:
    raise Unprintable


@app.triggered()
async def raises_a_base_exception_async() -> None:
    raise Abort("stop")


@app.triggered()
def raises_a_base_exception_sync() -> None:
    raise Abort("stop")


@app.triggered(timeout_s=60)
async def upstream_times_out_async() -> None:
    raise TimeoutError("upstream did not answer in 2 s")


@app.triggered(timeout_s=60)
def upstream_times_out_sync() -> None:
    raise TimeoutError("upstream did not answer in 2 s")


@app.triggered(max_concurrency=5)
async def minds_its_cancel(ctx: JobContext) -> None:
    def broken() -> None:
        raise RuntimeError("the job's own cleanup hook fails")

    ctx.cancellation.on_set(broken)
    await ctx.cancellation.wait()


@pytest.mark.parametrize("key", ["awaits_a_cancelled_future", "waits_for_a_cancelled_future"])
async def test_a_cancelled_error_of_the_jobs_own_is_its_failure_and_is_retried(
    pg_store: SqlStore, redis_bus: Bus, key: str
) -> None:
    """Nobody asked the attempt to stop: not released as at a shutdown (and run again, for
    ever), but Failed, its retry used, then Terminated."""
    async with running_worker(app, pg_store, redis_bus):
        instance = await Dispatcher(pg_store, redis_bus).trigger(key)
        [done] = await settled(pg_store, [instance.id], timeout_s=10)
    assert done.state is S.TERMINATED and done.attempt == 2 and done.retries_used == 1
    assert done.error is not None and done.error.type == "CancelledError"
    history = [(t.from_state, t.to_state, t.reason) for t in await pg_store.transitions(done.id)]
    assert history == [
        (None, S.ENQUEUED, None),
        (S.ENQUEUED, S.PROCESSING, None),
        (S.PROCESSING, S.FAILED, "exception"),
        (S.FAILED, S.ENQUEUED, "retry 1 of 1"),
        (S.ENQUEUED, S.PROCESSING, None),
        (S.PROCESSING, S.FAILED, "exception"),
        (S.FAILED, S.TERMINATED, "no attempts left"),
    ]


@pytest.mark.parametrize(
    ("key", "error", "message"),
    [
        ("raises_unprintable_async", "Unprintable", "<Unprintable: str() failed>"),
        ("raises_unprintable_sync", "Unprintable", "<Unprintable: str() failed>"),
        ("raises_a_base_exception_async", "Abort", "stop"),
        ("raises_a_base_exception_sync", "Abort", "stop"),
    ],
)
async def test_an_exception_that_cannot_print_or_is_no_exception_is_recorded(
    pg_store: SqlStore, redis_bus: Bus, key: str, error: str, message: str
) -> None:
    async with running_worker(app, pg_store, redis_bus) as worker:
        instance = await Dispatcher(pg_store, redis_bus).trigger(key)
        [done] = await settled(pg_store, [instance.id], timeout_s=10)
    assert done.state is S.TERMINATED and done.reason == "no attempts left"
    assert done.error is not None
    assert (done.error.type, done.error.message) == (error, message)
    assert done.error.traceback is not None and error in done.error.traceback
    assert done.unexpected_retries_used == 0  # recorded, not left to the reaper
    label = {"job": key, "outcome": "failed"}
    assert worker.metrics.registry.get_sample_value(
        "jobplane_worker_attempts_finished_total", label
    )


@pytest.mark.parametrize("key", ["upstream_times_out_async", "upstream_times_out_sync"])
async def test_a_timeout_error_of_the_jobs_own_is_no_timeout_of_its_attempt(
    pg_store: SqlStore, redis_bus: Bus, key: str
) -> None:
    """A call of the job's timed out, long before the job's 60 s: its exception, recorded as
    it was, not "timed out after 60 s" with the reason timeout."""
    async with running_worker(app, pg_store, redis_bus):
        instance = await Dispatcher(pg_store, redis_bus).trigger(key)
        [done] = await settled(pg_store, [instance.id], timeout_s=10)
    assert done.state is S.TERMINATED and done.error is not None
    assert (done.error.type, done.error.message) == (
        "TimeoutError",
        "upstream did not answer in 2 s",
    )
    failed = [t for t in await pg_store.transitions(done.id) if t.to_state is S.FAILED]
    assert [t.reason for t in failed] == ["exception"]


async def test_a_cancellation_callback_that_raises_ends_nothing_but_its_job(
    pg_store: SqlStore, redis_bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    """A job's callback on its cancellation runs inside the worker's cancel, heartbeat, fence
    and drain code: what it raises is logged there, and the attempt still ends Cancelled."""
    dispatcher = Dispatcher(pg_store, redis_bus)
    async with running_worker(app, pg_store, redis_bus):
        first = await dispatcher.trigger("minds_its_cancel")

        async def running() -> bool:
            return (await pg_store.get_instance(first.id)).state is S.PROCESSING

        await wait_for(running)
        await dispatcher.cancel(first.id)
        [cancelled] = await settled(pg_store, [first.id], timeout_s=10)
        second = await dispatcher.trigger("upstream_times_out_async")  # the worker serves on
        await settled(pg_store, [second.id], timeout_s=10)
    assert cancelled.state is S.CANCELLED
    assert any(getattr(r, "action", None) == "worker.cancellation_callback" for r in caplog.records)


class Garbled(Exception):
    """An exception whose text a store cannot keep as it is."""


@app.triggered()
async def raises_a_nul() -> None:
    raise Garbled("before\x00after")


@app.triggered()
def raises_a_lone_surrogate() -> None:
    raise Garbled("before\ud800after")  # as from bytes decoded with surrogateescape


@pytest.mark.parametrize(
    ("key", "message"),
    [("raises_a_nul", "before\\x00after"), ("raises_a_lone_surrogate", "before\\ud800after")],
)
async def test_error_text_a_store_cannot_keep_is_recorded_escaped_on_both_stores(
    store: SqlStore, redis_bus: Bus, key: str, message: str
) -> None:
    """Postgres' jsonb refuses NUL and lone surrogates: the outcome was recorded as
    OutcomeNotStored there, the job's error type, message and traceback lost, while SQLite
    kept them. Made visible, both stores keep the same."""
    async with running_worker(app, store, redis_bus):
        instance = await Dispatcher(store, redis_bus).trigger(key)
        [done] = await settled(store, [instance.id], timeout_s=10)
    assert done.state is S.TERMINATED and done.error is not None
    assert (done.error.type, done.error.message) == ("Garbled", message)
    assert done.error.traceback is not None and message in done.error.traceback


@app.triggered()
async def raises_a_megabyte() -> None:
    raise Garbled("start" + "x" * 1_000_000 + "END")


async def test_a_huge_error_is_recorded_cut_to_its_beginning_and_end(
    store: SqlStore, redis_bus: Bus
) -> None:
    """A 40 MB message was stored whole, as an 84 MB row (the traceback repeats it), which
    every listing then read. Each part is bounded; the cut says how much was left out."""
    async with running_worker(app, store, redis_bus):
        instance = await Dispatcher(store, redis_bus).trigger("raises_a_megabyte")
        [done] = await settled(store, [instance.id], timeout_s=10)
    assert done.state is S.TERMINATED and done.error is not None
    message, traceback = done.error.message, done.error.traceback
    assert len(message) <= MESSAGE_MAX and message.startswith("start") and message.endswith("END")
    assert "characters cut ...]" in message
    assert traceback is not None and len(traceback) <= TRACEBACK_MAX
    assert traceback.startswith("Traceback") and traceback.endswith("END\n")


async def test_a_worker_says_at_start_which_jobs_lack_a_resource(
    store: SqlStore, redis_bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    """Found at the first attempt only, a resource no startup hook returns failed every run
    of the job with "needs resource", in production; the worker now says so as it starts."""
    lacking = App("lacking")

    @lacking.triggered()
    async def mails(mailer: object, retries: int = 2) -> None: ...

    @lacking.triggered()
    async def fine(ctx: JobContext) -> None: ...

    async with running_worker(lacking, store, redis_bus):
        pass
    said = [r for r in caplog.records if getattr(r, "action", None) == "worker.resource_missing"]
    assert [r.getMessage() for r in said] == [
        "job mails needs resource(s) 'mailer', which no startup hook returned: each of its "
        "attempts will fail"
    ]
