"""Instances of a job no live worker knows: their messages are not multiplied by the sweep,
and they end Terminated ("no worker knows the job") after the configured time."""

from __future__ import annotations

import asyncio
import logging

import pytest

from jobplane import App, JobContext
from jobplane.bus.abc import Bus
from jobplane.dispatch import Dispatcher
from jobplane.domain.models import WorkerInfo
from jobplane.domain.reasons import EndReason
from jobplane.domain.states import InstanceState as S
from jobplane.store.sql import SqlStore
from tests.scheduler_helpers import running_scheduler
from tests.store_helpers import define, enqueue
from tests.worker_helpers import running_worker, settled, wait_for

pytestmark = pytest.mark.timeout(120)

BACKLOG = 40

other = App("other")


@other.triggered(key="known")
async def known() -> None: ...


async def _stream_length(bus: Bus) -> int:
    return sum((await bus.stream_lengths("default")).values())


@pytest.mark.parametrize("with_worker", [False, True], ids=["no-worker", "worker-without-it"])
async def test_a_backlog_of_an_unknown_job_never_grows_the_stream(
    store: SqlStore, bus: Bus, caplog: pytest.LogCaptureFixture, with_worker: bool
) -> None:
    """The sweep republishes unclaimed instances every ``republish_after_s`` (1 s here); one
    whose message is still in its stream (unread, or put back by a worker that does not know
    its job) is not published again. (An entry delivered and left unacknowledged longer than
    that counts as lost: with 0.5 s, a put-back round slowed by a loaded machine, reading the
    workers and the instances again, once took longer, and the stream grew.)"""
    caplog.set_level(logging.INFO, logger="jobplane_worker.worker")
    await define(store, "orphan", max_concurrency=1000)
    async with Dispatcher(store, bus) as dispatcher:  # (the messages are sent on leaving)
        made = [await dispatcher.trigger("orphan") for _ in range(BACKLOG)]
    assert await _stream_length(bus) == BACKLOG
    lengths = []
    async with running_scheduler(store, bus, republish_after_s=1.0):
        if with_worker:
            async with running_worker(other, store, bus):
                for _ in range(32):  # four republish intervals, twenty sweeps
                    await asyncio.sleep(0.125)
                    lengths.append(await _stream_length(bus))
        else:
            for _ in range(32):
                await asyncio.sleep(0.125)
                lengths.append(await _stream_length(bus))
    assert max(lengths) <= BACKLOG, lengths
    assert {(await store.get_instance(i.id)).state for i in made} == {S.ENQUEUED}
    put_back = [r for r in caplog.records if getattr(r, "action", "") == "worker.unknown_job"]
    assert len(put_back) <= 1  # rate-limited: one line per job per minute


async def test_an_unknown_jobs_instance_ends_terminated(store: SqlStore, bus: Bus) -> None:
    await define(store, "orphan", max_concurrency=10)
    await define(store, "known", max_concurrency=10)
    [lost] = await enqueue(store, "orphan")
    [kept] = await enqueue(store, "known")

    async def terminated() -> bool:
        return (await store.get_instance(lost.id)).state is S.TERMINATED

    async with (
        running_worker(other, store, bus),
        running_scheduler(store, bus, unknown_job_timeout_s=0.5),
    ):
        await wait_for(terminated, timeout_s=15, what="the orphan terminated")
    ended = await store.get_instance(lost.id)
    assert ended.reason == EndReason.NO_WORKER_KNOWS
    steps = [(t.from_state, t.to_state, t.reason) for t in await store.transitions(lost.id)]
    assert steps[-1] == (S.ENQUEUED, S.TERMINATED, EndReason.NO_WORKER_KNOWS)
    assert (await store.get_instance(kept.id)).state is S.SUCCEEDED


async def test_terminate_unknown_jobs_waits_for_the_timeout_and_for_recent_workers(
    store: SqlStore,
) -> None:
    await define(store, "orphan", max_concurrency=10)
    await define(store, "gone", max_concurrency=10)
    await define(store, "known", max_concurrency=10)
    live = WorkerInfo(
        id="live", host="h", pid=1, queues=("default",), capacity=1, version="x", jobs=("known",)
    )
    left = WorkerInfo(
        id="left", host="h", pid=2, queues=("default",), capacity=1, version="x", jobs=("gone",)
    )
    await store.register_worker(live)
    await store.register_worker(left)
    lease = await store.acquire_leadership(0, "s1", 30)
    assert lease is not None
    [orphan] = await enqueue(store, "orphan")
    [gone] = await enqueue(store, "gone")
    [known] = await enqueue(store, "known")
    # (A timeout of a second, and no sleep between the stop and the sweep after it: a loaded
    # machine stretched shorter ones until "gone" was also past its timeout.)
    assert await store.terminate_unknown_jobs(lease, 1.0) == []  # too young
    await asyncio.sleep(1.0)
    await store.worker_stopped("left")  # "gone" was known until now
    [ended] = await store.terminate_unknown_jobs(lease, 1.0)
    assert ended.id == orphan.id and ended.state is S.TERMINATED
    assert ended.reason == EndReason.NO_WORKER_KNOWS
    await asyncio.sleep(1.0)
    [later] = await store.terminate_unknown_jobs(lease, 1.0)
    assert later.id == gone.id
    assert (await store.get_instance(known.id)).state is S.ENQUEUED


pool = App("pool")


@pool.triggered(key="train", queue="gpu")
async def train(ctx: JobContext) -> str:
    return ctx.worker_id


earlier_pool = App("pool")  # the same app, a release before ``train`` existed


@earlier_pool.triggered(key="known")
async def known_earlier() -> None: ...


async def test_an_entry_is_forwarded_only_to_a_worker_that_consumes_its_queue(
    store: SqlStore, bus: Bus
) -> None:
    """A worker of the gpu queue that does not know a gpu job (a rollout half done) forwarded
    its entry to any live worker that knew the job, one of the cpu pool included, which ran
    it: its claim does not look at queues. It now waits for a worker of the gpu queue."""
    async with (
        running_worker(pool, store, bus, worker_id="cpu-1", queues=["default"]),
        running_worker(earlier_pool, store, bus, worker_id="gpu-1", queues=["gpu"]),
    ):
        instance = await Dispatcher(store, bus).trigger("train")
        await asyncio.sleep(1.5)  # many put-back rounds (0.1 s apart here)
        waiting = await store.get_instance(instance.id)
        assert waiting.state is S.ENQUEUED and waiting.attempt == 0
        async with running_worker(pool, store, bus, worker_id="gpu-2", queues=["gpu"]):
            [done] = await settled(store, [instance.id])
    assert done.state is S.SUCCEEDED and done.result == "gpu-2"


async def test_an_instance_pinned_to_a_worker_that_does_not_know_its_job_is_unpinned(
    store: SqlStore, bus: Bus
) -> None:
    """Pinned to a live worker without its job: that worker forwarded the entry to one that
    knew the job, whose claim refused the pin and dropped the entry; the sweep republished it
    to the pinned worker, and round it went, the instance Enqueued for ever. The entry now
    waits at its worker, and once the unknown-job timeout has passed the sweep applies the
    job's ``pin_fallback`` (``any``: unpinned, run by a worker that knows the job)."""
    async with (
        running_worker(pool, store, bus, worker_id="trainer", queues=["gpu"]),
        running_worker(earlier_pool, store, bus, worker_id="old", queues=["gpu"]),
        running_scheduler(store, bus, republish_after_s=1.0, unknown_job_timeout_s=1.0),
    ):
        instance = await Dispatcher(store, bus).trigger("train", pinned_worker="old")
        [done] = await settled(store, [instance.id], timeout_s=30)
    # Run by the other worker: only once unpinned (a claim refuses an instance pinned to
    # another worker). The reason the sweep gives is checked in tests/test_sweeps.py.
    assert done.state is S.SUCCEEDED and done.result == "trainer"
    assert done.pinned_worker is None
