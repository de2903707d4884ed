"""Entries of jobs a worker does not know: put back (``requeue``) or handed to a worker that
knows the job (``forward``). An entry is moved once, whoever holds it: a put-back of an entry
already moved or acknowledged adds no copy, on either bus."""

from __future__ import annotations

import asyncio
import uuid

from jobplane import App
from jobplane.bus.abc import Bus
from jobplane.bus.envelope import Envelope
from jobplane.store.sql import SqlStore
from tests.store_helpers import define, enqueue
from tests.worker_helpers import running_worker

other = App("moves-other")


@other.triggered(key="known")
async def known() -> None:
    """The only job this app knows: every entry below is of a job it does not."""


async def _queued(bus: Bus) -> int:
    return sum((await bus.stream_lengths("default")).values())


async def test_a_put_back_of_an_entry_moved_or_acknowledged_since_adds_no_copy(bus: Bus) -> None:
    """Done twice for one delivery (a reclaim handed it back meanwhile), or after another
    consumer acknowledged it, the Redis bus added a copy each time."""
    sent = Envelope(instance_id=uuid.uuid4(), job_key="job", priority=5)
    await bus.publish([("default", sent)])
    a, b = bus.consumer("a", ["default"]), bus.consumer("b", ["default"])
    [held] = await a.read(1, 50)
    await a.requeue([held])
    await a.requeue([held])  # the same delivery once more
    assert await _queued(bus) == 1
    [again] = await b.read(1, 50)
    await b.ack([again])  # claimed and acknowledged by b
    await a.requeue([again])  # a late put-back of an entry b already handled
    await a.forward([again], "c")  # nor is it handed on
    assert await _queued(bus) == 0
    assert await b.read(5, 50) == []
    assert await bus.consumer("c", ["default"]).read(5, 50) == []


async def test_a_put_back_round_of_many_unknown_jobs_does_not_multiply_their_entries(
    pg_store: SqlStore, bus: Bus
) -> None:
    """The put-back waited ``unknown_job_delay_s`` once per job, with its entries pending on
    this worker: with 20 jobs a round (2 s here) outlasted ``reclaim_idle_s`` (1 s), the
    worker's own reclaim handed it the same entries again, and each was put back twice, its
    copies again: 20 entries became 222 in 12 s on Redis (30 unknown jobs do it with the
    default settings)."""
    made = []
    for i in range(20):
        await define(pg_store, f"orphan-{i:02d}", max_concurrency=10)
        made += await enqueue(pg_store, f"orphan-{i:02d}")
    await bus.publish([("default", Envelope(i.id, i.job_key, i.priority)) for i in made])
    lengths = []
    async with running_worker(other, pg_store, bus):  # (reclaim after 1 s, put back after 0.1 s)
        for _ in range(10):
            await asyncio.sleep(0.5)
            lengths.append(await _queued(bus))
    assert max(lengths) <= len(made), lengths
