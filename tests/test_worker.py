"""The walking skeleton and the worker's behaviour, on every store and bus combination."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import update

from jobplane import App, JobContext
from jobplane.bus.abc import Bus
from jobplane.bus.envelope import Envelope
from jobplane.dispatch import Dispatcher
from jobplane.domain.states import InstanceState as S
from jobplane.store.sql import SqlStore
from jobplane.store.tables import job_instances
from tests.apps.basic import EchoArgs, app
from tests.scheduler_helpers import running_scheduler
from tests.worker_helpers import running_worker, settled, wait_for


async def test_triggered_job_runs_to_succeeded_with_history(store: SqlStore, bus: Bus) -> None:
    async with running_worker(app, store, bus) as worker:
        dispatcher = Dispatcher(store, bus)
        instance = await dispatcher.trigger("echo", {"value": 41})
        assert instance.state is S.ENQUEUED
        [done] = await settled(store, [instance.id])
    assert done.state is S.SUCCEEDED
    assert done.result == {"value": 41, "worker": worker.id}
    history = await store.transitions(instance.id)
    assert [(t.from_state, t.to_state) for t in history] == [
        (None, S.ENQUEUED),
        (S.ENQUEUED, S.PROCESSING),
        (S.PROCESSING, S.SUCCEEDED),
    ]
    assert history[1].actor == worker.id


async def test_sync_and_async_jobs_in_one_batch(store: SqlStore, bus: Bus) -> None:
    async with running_worker(app, store, bus, concurrency=8):
        dispatcher = Dispatcher(store, bus)
        made = [await dispatcher.trigger("echo", {"value": i}) for i in range(10)]
        made += [await dispatcher.trigger("add_sync", {"value": i}) for i in range(10)]
        done = await settled(store, [i.id for i in made])
    assert {i.state for i in done} == {S.SUCCEEDED}
    assert sorted(i.result for i in done if i.job_key == "add_sync") == list(range(1, 11))


async def test_exception_retries_then_terminates_with_the_traceback(
    store: SqlStore, bus: Bus
) -> None:
    async with running_worker(app, store, bus):
        instance = await Dispatcher(store, bus).trigger("always_fails")
        [done] = await settled(store, [instance.id])
    assert done.state is S.TERMINATED and done.retries_used == 2 and done.attempt == 3
    assert done.error is not None and done.error.type == "ValueError"
    assert done.error.traceback is not None and "no luck" in done.error.traceback
    steps = [t.to_state for t in await store.transitions(instance.id)]
    assert steps.count(S.FAILED) == 3 and steps[-1] is S.TERMINATED


async def test_a_retry_deep_into_an_exponential_backoff_waits_its_cap(
    store: SqlStore, bus: Bus
) -> None:
    """The 1,101st retry of a job whose backoff grows 1,000-fold: 1000.0 ** 1100 overflows a
    float. The failure is recorded and the retry waits ``max_delay_s``; the attempt's end
    once raised OverflowError in the worker, leaving the instance Processing until its lease
    ran out, again at every attempt."""
    late = App("late")

    @late.triggered(
        retries=2_000_000,
        backoff={"kind": "exponential", "factor": 1000, "max_delay_s": 30, "jitter": False},
    )
    async def fails_late() -> None:
        raise RuntimeError("fails again")

    async with running_worker(late, store, bus):
        dispatcher = Dispatcher(store, bus)
        made = await dispatcher.trigger("fails_late", delay=timedelta(hours=1))  # not claimed
        async with store.engine.begin() as conn:
            await conn.execute(
                update(job_instances).where(job_instances.c.id == made.id).values(retries_used=1100)
            )
        await dispatcher.run_now(made.id)

        async def retry_planned() -> bool:
            return (await store.get_instance(made.id)).state is S.SCHEDULED

        await wait_for(retry_planned, what="the retry to be planned")
    retry = await store.get_instance(made.id)
    assert retry.retries_used == 1101 and retry.error is not None
    assert retry.error.message == "fails again"
    failed = [t for t in await store.transitions(made.id) if t.to_state is S.FAILED]
    assert retry.run_at is not None and len(failed) == 1
    assert abs((retry.run_at - failed[0].at).total_seconds() - 30) < 2


async def test_async_timeout_fails_the_attempt(store: SqlStore, bus: Bus) -> None:
    async with running_worker(app, store, bus):
        instance = await Dispatcher(store, bus).trigger("too_slow")
        [done] = await settled(store, [instance.id])
    assert done.state is S.TERMINATED
    failed = [t for t in await store.transitions(instance.id) if t.to_state is S.FAILED]
    assert failed[0].reason == "timeout"


async def test_result_that_is_not_json_fails_clearly(store: SqlStore, bus: Bus) -> None:
    async with running_worker(app, store, bus):
        instance = await Dispatcher(store, bus).trigger("returns_garbage")
        [done] = await settled(store, [instance.id])
    assert done.state is S.TERMINATED
    assert done.error is not None and "not JSON serialisable" in done.error.message


async def test_cancel_while_running(store: SqlStore, bus: Bus) -> None:
    async with running_worker(app, store, bus):
        instance = await Dispatcher(store, bus).trigger("sync_sleeper")

        async def running() -> bool:
            return (await store.get_instance(instance.id)).state is S.PROCESSING

        await wait_for(running)
        await Dispatcher(store, bus).cancel(instance.id, "test")
        [done] = await settled(store, [instance.id])
    assert done.state is S.CANCELLED


async def test_max_concurrency_skips_the_excess(store: SqlStore, bus: Bus) -> None:
    limited = App("limited")

    @limited.triggered(max_concurrency=1)
    async def single(ctx: JobContext) -> None:
        await asyncio.sleep(0.5)

    async with running_worker(limited, store, bus, concurrency=4):
        dispatcher = Dispatcher(store, bus)
        made = [await dispatcher.trigger("single") for _ in range(3)]
        done = await settled(store, [i.id for i in made])
    assert sorted(i.state for i in done) == sorted([S.SUCCEEDED, S.SKIPPED, S.SKIPPED])


async def test_progress_and_checkpoint_reach_the_store(store: SqlStore, bus: Bus) -> None:
    steps = App("steps")

    @steps.triggered(retries=1, backoff={"kind": "none"})
    async def paged(ctx: JobContext) -> int:
        start = ctx.last_checkpoint or 0
        ctx.progress(0.5, "half")
        await ctx.checkpoint(start + 10)
        await asyncio.sleep(0.5)  # a heartbeat carries the progress
        if ctx.attempt == 1:
            raise RuntimeError("first attempt fails after its checkpoint")
        return int(start)

    async with running_worker(steps, store, bus):
        instance = await Dispatcher(store, bus).trigger("paged")
        [done] = await settled(store, [instance.id])
    assert done.state is S.SUCCEEDED and done.result == 10  # restored on the next attempt
    assert done.checkpoint == 20 and done.progress == 0.5 and done.progress_message == "half"


async def test_job_unknown_to_a_worker_is_left_for_one_that_knows_it(
    store: SqlStore, bus: Bus
) -> None:
    partial = App("partial")

    @partial.triggered(key="echo")
    async def other_echo() -> None: ...

    # The definition of add_sync exists, but the first worker does not know it.
    async with running_worker(app, store, bus, worker_id="knows-all", queues=["unused"]):
        pass
    async with running_worker(partial, store, bus, worker_id="knows-echo"):
        instance = await Dispatcher(store, bus).trigger("add_sync", {"value": 1})
        await asyncio.sleep(0.5)
        assert (await store.get_instance(instance.id)).state is S.ENQUEUED
        async with running_worker(app, store, bus, worker_id="knows-all-2"):
            [done] = await settled(store, [instance.id])
    assert done.state is S.SUCCEEDED and done.worker_id == "knows-all-2"


async def test_process_isolation_runs_and_reports_errors(store: SqlStore, bus: Bus) -> None:
    async with running_worker(app, store, bus):
        dispatcher = Dispatcher(store, bus)
        ok = await dispatcher.trigger("child_square", {"value": 12})
        bad = await dispatcher.trigger("child_fails")
        ok_done, bad_done = await settled(store, [ok.id, bad.id], timeout_s=60)
    assert ok_done.state is S.SUCCEEDED and ok_done.result == 144
    assert bad_done.state is S.TERMINATED and bad_done.error is not None
    assert bad_done.error.type == "KeyError" and "inside the child" in (
        bad_done.error.traceback or ""
    )


# On each store, over one bus: what this checks (the timeout, the child's kill, the slot given
# back) happens in the worker and its store; the bus only delivers the two instances, as in every
# other test here over both buses (and the same runaway over Redis is killed in
# test_worker_isolation.py). Each run waits out the job's timeout twice (10 s).
@pytest.mark.long
@pytest.mark.parametrize("bus", ["memory"], indirect=True)
async def test_process_isolation_kills_a_runaway_and_frees_its_slot(
    store: SqlStore, bus: Bus, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="jobplane_worker.isolation")
    pid_file = tmp_path / "pid"
    async with running_worker(app, store, bus):
        instance = await Dispatcher(store, bus).trigger("runaway", {"path": str(pid_file)})
        [done] = await settled(store, [instance.id], timeout_s=60)
        # The slot was given back: a second instance can claim it.
        again = await Dispatcher(store, bus).trigger("runaway", {"path": str(pid_file)})
        [second] = await settled(store, [again.id], timeout_s=60)
    assert done.state is S.TERMINATED and done.error is not None
    assert done.error.type == "TimeoutError"
    assert second.state is S.TERMINATED and second.attempt == 1
    # The children as the worker logged their ends (not from the pid file: on a loaded machine a
    # child can be stopped by its timeout before its code ran far enough to write it).
    pids = [
        r.args[0]
        for r in caplog.records
        if getattr(r, "action", None) == "worker.child_exited" and isinstance(r.args, tuple)
    ]
    assert len(pids) == 2
    for pid in pids:
        assert isinstance(pid, int)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # the child is really gone


async def test_pinned_instance_runs_on_the_named_worker(store: SqlStore, bus: Bus) -> None:
    async with (
        running_worker(app, store, bus, worker_id="w-one"),
        running_worker(app, store, bus, worker_id="w-two"),
    ):
        dispatcher = Dispatcher(store, bus)
        made = [
            await dispatcher.trigger("echo", {"value": i}, pinned_worker="w-two") for i in range(5)
        ]
        done = await settled(store, [i.id for i in made])
    assert {i.worker_id for i in done} == {"w-two"}
    assert {i.result["worker"] for i in done} == {"w-two"}


async def test_pinned_to_a_dead_worker_falls_back_to_any(store: SqlStore, bus: Bus) -> None:
    async with running_worker(app, store, bus, worker_id="w-live"):
        async with running_worker(app, store, bus, worker_id="w-gone"):
            pass  # registered, then stopped
        instance = await Dispatcher(store, bus).trigger(
            "echo", {"value": 1}, pinned_worker="w-gone"
        )
        async with running_scheduler(store, bus):
            [done] = await settled(store, [instance.id])
    assert done.state is S.SUCCEEDED and done.worker_id == "w-live"


async def test_priority_order_under_a_backlog(store: SqlStore, bus: Bus) -> None:
    ordered = App("ordered")
    started: list[int] = []

    @ordered.triggered(max_concurrency=100)
    async def note(args: EchoArgs) -> None:
        started.append(args.value)

    await store.register_definition(ordered.jobs["note"].options, None, "test")
    dispatcher = Dispatcher(store, bus)
    # The backlog builds up while no worker runs: low, then normal, then high priority.
    for priority in (1, 5, 9):
        for _ in range(3):
            await dispatcher.trigger("note", {"value": priority}, priority=priority)
    async with running_worker(ordered, store, bus, concurrency=1, batch_size=1):
        await wait_for(lambda: _count_is(started, 9), what="the backlog to drain")
    assert started == [9, 9, 9, 5, 5, 5, 1, 1, 1]


async def _count_is(items: list[int], n: int) -> bool:
    return len(items) >= n


async def test_a_worker_registers_its_jobs_under_its_apps_name(store: SqlStore, bus: Bus) -> None:
    async with running_worker(app, store, bus, worker_id="w-app"):
        pass
    registered = await store.list_definitions(app=app.name)
    assert {d.key for d in registered} == set(app.jobs)
    assert all(d.app == app.name for d in registered)


same_worker = App("same-worker")


@same_worker.triggered(retries=1, retry_on_same_worker=True, backoff={"kind": "none"})
async def fails_once(ctx: JobContext) -> str:
    if ctx.attempt == 1:
        raise RuntimeError("the first attempt fails")
    return ctx.worker_id


class _SentBus:
    """The bus, noting every envelope published through it."""

    def __init__(self, bus: Bus) -> None:
        self._bus = bus
        self.sent: list[Envelope] = []

    async def publish(self, envelopes: Sequence[tuple[str, Envelope]]) -> None:
        self.sent.extend(envelope for _, envelope in envelopes)
        await self._bus.publish(envelopes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bus, name)


async def test_a_retry_kept_to_its_worker_is_published_to_that_worker(
    store: SqlStore, bus: Bus
) -> None:
    """The retry's row is pinned to the worker of the failed attempt; its message went to the
    queue (the claim-time copy had no pin), where another worker read it, could not claim it
    and dropped it: the retry waited for the sweep's republish (30 s), or for ever without a
    leader."""
    sent = _SentBus(bus)
    async with running_worker(same_worker, store, sent) as first:
        instance = await Dispatcher(store, bus).trigger("fails_once")
        async with running_worker(same_worker, store, bus):  # another worker reads the queue
            [done] = await settled(store, [instance.id], timeout_s=20)
    assert done.state is S.SUCCEEDED and done.result == first.id, (done.state, done.error)
    [retry] = [e for e in sent.sent if e.instance_id == instance.id]
    assert retry.pinned_worker == first.id
