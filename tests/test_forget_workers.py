"""Workers stopped long ago are forgotten: their rows in the store, their own streams and
their consumers on the bus. Every process start is a worker of its own (a deploy, a crash,
a scale-up), and nothing removed them: the workers table, the streams ``w:{id}`` and the
consumers of every band group grew for as long as the cluster ran."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from sqlalchemy import update

from jobplane.bus.abc import Bus
from jobplane.bus.envelope import Envelope
from jobplane.bus.keys import GROUP
from jobplane.bus.redis import RedisBus
from jobplane.domain.models import ErrorInfo, NewInstance, Outcome, WorkerInfo
from jobplane.domain.states import InstanceState
from jobplane.errors import NotLeaderError
from jobplane.store.sql import SqlStore
from jobplane.store.tables import workers
from jobplane_scheduler.housekeeping import forget_stopped_workers
from tests.store_helpers import define


def _worker(worker_id: str) -> WorkerInfo:
    return WorkerInfo(worker_id, "h", 1, ("default",), 2, "1", ("job",))


async def _stopped_ago(store: SqlStore, worker_id: str, hours: float) -> None:
    await store.worker_stopped(worker_id)
    at = await store.now() - timedelta(hours=hours)
    async with store.engine.begin() as conn:
        await conn.execute(update(workers).where(workers.c.id == worker_id).values(stopped_at=at))


async def test_the_rows_of_workers_stopped_before_a_time_are_deleted(store: SqlStore) -> None:
    await define(store, "job")
    for worker_id in ("old", "recent", "live", "old-runaway"):
        await store.register_worker(_worker(worker_id))
    # A slot still held by runaway code of "old-runaway": its row stays until it is given back.
    [made] = await store.create_instances([NewInstance(job_key="job")])
    [claim] = (await store.claim([made.id], "old-runaway", 30, ["job"])).claimed
    timeout = ErrorInfo(type="TimeoutError", message="execution timeout")
    await store.complete(
        [Outcome(made.id, claim.token, InstanceState.FAILED, error=timeout, holds_slot=True)]
    )
    await _stopped_ago(store, "old", 30)
    await _stopped_ago(store, "old-runaway", 30)
    await _stopped_ago(store, "recent", 1)
    lease = await store.acquire_leadership(0, "s", 30)
    assert lease is not None
    before = await store.now() - timedelta(hours=24)
    gone = await store.forget_stopped_workers(before, fence=lease)
    assert [w.id for w in gone] == ["old"] and gone[0].queues == ("default",)
    assert sorted(w.id for w in await store.list_workers()) == ["live", "old-runaway", "recent"]
    assert await store.forget_stopped_workers(before, fence=lease) == []
    assert await store.release_runaway_slot(made.id, claim.token)
    assert [w.id for w in await store.forget_stopped_workers(before, fence=lease)] == [
        "old-runaway"
    ]
    # Fenced: a deposed leader deletes nothing.
    await _stopped_ago(store, "recent", 30)
    assert await store.release_leadership(0, "s", lease.term)
    with pytest.raises(NotLeaderError):
        await store.forget_stopped_workers(before, fence=lease)
    assert sorted(w.id for w in await store.list_workers()) == ["live", "recent"]


async def test_a_forgotten_worker_leaves_no_stream_and_keeps_nothing_pending(bus: Bus) -> None:
    pinned = Envelope(uuid.uuid4(), "job", 5, pinned_worker="gone")
    await bus.publish([("default", Envelope(uuid.uuid4(), "job", 5)), ("default", pinned)])
    consumer = bus.consumer("gone", ["default"])
    held = await consumer.read(10, 50)
    assert {d.envelope.instance_id for d in held} >= {pinned.instance_id}
    # An entry still pending on its consumer: kept for another worker to reclaim.
    unacked = next(d for d in held if d.envelope.pinned_worker is None)
    await consumer.ack([d for d in held if d is not unacked])
    await bus.publish([("default", Envelope(uuid.uuid4(), "job", 5, pinned_worker="gone"))])
    assert await bus.forget_worker("gone", ["default"]) is False
    [reclaimed] = await bus.consumer("other", ["default"]).reclaim(0, 10)
    assert reclaimed.envelope == unacked.envelope
    # Nothing pending on it now: its consumers go, its own stream with its entry too.
    assert await bus.forget_worker("gone", ["default"]) is True
    if isinstance(bus, RedisBus):
        assert not await bus.client.exists(bus.keys.worker_stream("gone"))
        for stream in bus.keys.queue_streams("default"):
            assert "gone" not in await _consumers(bus, stream)
    assert await bus.consumer("gone", ["default"]).read(10, 50) == []  # (made anew, empty)


async def test_the_leader_forgets_workers_stopped_a_day_ago_in_the_store_and_on_the_bus(
    pg_store: SqlStore, redis_bus: Bus
) -> None:
    assert isinstance(redis_bus, RedisBus)
    stream = redis_bus.keys.queue_streams("default")[0]
    for worker_id in ("gone", "here"):
        await pg_store.register_worker(_worker(worker_id))
        await redis_bus.publish([("default", Envelope(uuid.uuid4(), "job", 9))])
        consumer = redis_bus.consumer(worker_id, ["default"])
        await consumer.ack(await consumer.read(10, 20))  # its groups and consumers made
    assert await _consumers(redis_bus, stream) == {"gone", "here"}
    await _stopped_ago(pg_store, "gone", 30)
    lease = await pg_store.acquire_leadership(0, "s", 30)
    assert lease is not None
    forgotten = await forget_stopped_workers(pg_store, redis_bus, timedelta(days=1), lease)
    assert forgotten == ["gone"]
    assert [w.id for w in await pg_store.list_workers()] == ["here"]
    assert await _consumers(redis_bus, stream) == {"here"}
    assert not await redis_bus.client.exists(redis_bus.keys.worker_stream("gone"))
    assert await redis_bus.client.exists(redis_bus.keys.worker_stream("here"))


async def _consumers(bus: RedisBus, stream: str) -> set[str]:
    if not await bus.client.exists(stream):
        return set()
    names = [c["name"] for c in await bus.client.xinfo_consumers(stream, GROUP)]
    return {n.decode() if isinstance(n, bytes) else str(n) for n in names}
