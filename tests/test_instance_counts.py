"""The instance counters (migration 0017) agree with the rows, on Postgres and SQLite, after
inserts, claims, ends, retries, cancels, skips and retention deletes; so do the metrics'
gauges, which read them."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from sqlalchemy import func, select, text, update

from jobplane.domain.models import ErrorInfo, Outcome, WorkerInfo
from jobplane.domain.states import InstanceState as S
from jobplane.store.engine import AsyncConnection
from jobplane.store.sql import SqlStore
from jobplane.store.tables import instance_counts, job_instances, workers
from tests.store_helpers import define, enqueue

T = job_instances.c


async def _counted(store: SqlStore, key: str | None = None) -> dict[S, int]:
    query = select(T.state, func.count()).group_by(T.state)
    if key is not None:
        query = query.where(T.job_key == key)
    async with store.engine.connect() as conn:
        return {S(state): n for state, n in await conn.execute(query)}


async def _counted_by_job(store: SqlStore) -> dict[tuple[str, S], int]:
    query = select(T.job_key, T.state, func.count()).group_by(T.job_key, T.state)
    async with store.engine.connect() as conn:
        return {(key, S(state)): n for key, state, n in await conn.execute(query)}


async def _live_workers(store: SqlStore) -> int:
    query = select(func.count()).select_from(workers).where(workers.c.stopped_at.is_(None))
    async with store.engine.connect() as conn:
        return int((await conn.execute(query)).scalar_one())


async def _agree(store: SqlStore) -> dict[S, int]:
    counts = await store.count_by_state()
    assert counts == await _counted(store)
    by_job, live = await store.gauges()
    assert by_job == await _counted_by_job(store)
    assert live == await _live_workers(store)
    for key in ("busy", "quiet"):
        assert await store.count_by_state(key) == await _counted(store, key)
    both = await store.count_by_state(job_keys=["busy", "quiet"])
    assert both == counts
    return counts


async def test_counters_follow_every_change(store: SqlStore) -> None:
    await define(store, "busy", max_concurrency=3, retries=1)
    await define(store, "quiet")
    assert await store.count_by_state() == {}
    assert await store.gauges() == ({}, 0)
    busy = await enqueue(store, "busy", n=5)
    await enqueue(store, "quiet", n=2)
    assert (await _agree(store)) == {S.ENQUEUED: 7}

    claimed = (await store.claim([i.id for i in busy], "w1", 30, ["busy"])).claimed
    assert len(claimed) == 3  # two more were skipped at the limit
    await _agree(store)
    ok, bad, cancelled = claimed
    failure = ErrorInfo(type="ValueError", message="no")
    await store.complete(
        [
            Outcome(ok.instance.id, ok.token, S.SUCCEEDED),
            Outcome(bad.instance.id, bad.token, S.FAILED, error=failure),  # retried
        ]
    )
    await store.request_cancel(cancelled.instance.id, "ops")
    await _agree(store)

    later = await store.now() + timedelta(seconds=1)
    await asyncio.sleep(1.1)
    await store.delete_finished_before(later)  # retention
    counts = await _agree(store)
    assert S.SUCCEEDED not in counts  # no zero entries
    assert ("busy", S.SUCCEEDED) not in (await store.gauges())[0]


async def test_the_gauges_count_the_workers_that_have_not_stopped(store: SqlStore) -> None:
    for name in ("w1", "w2", "w3"):
        await store.register_worker(WorkerInfo(name, "h", 1, ("default",), 2, "1"))
    await store.worker_stopped("w2")
    assert (await store.gauges())[1] == 2 == await _live_workers(store)
    await store.register_worker(WorkerInfo("w2", "h", 2, ("default",), 2, "1"))  # restarted
    assert (await store.gauges())[1] == 3


async def test_postgres_gauges_sum_the_shards_of_every_backend(pg_store: SqlStore) -> None:
    """Each backend adds to its own shard (pid modulo 16): changes made through two backends
    of different shards are counted once each."""
    await define(pg_store, "busy")
    first, second, _ = await enqueue(pg_store, "busy", n=3)
    held: list[AsyncConnection] = []
    shards: dict[int, AsyncConnection] = {}
    try:
        while len(shards) < 2:  # new backends until two fall in different shards
            conn = await pg_store.engine.connect()
            held.append(conn)
            pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
            shards.setdefault(pid % 16, conn)
        for conn, instance in zip(shards.values(), (first, second), strict=True):
            await conn.execute(
                update(job_instances)
                .where(T.id == instance.id)
                .values(state=S.CANCELLED.value, finished_at=func.now())
            )
            await conn.commit()
    finally:
        for conn in held:
            await conn.close()
    async with pg_store.engine.connect() as conn:
        written = await conn.execute(
            select(func.count(func.distinct(instance_counts.c.shard))).where(
                instance_counts.c.state == S.CANCELLED.value
            )
        )
        assert written.scalar_one() == 2
    assert (await pg_store.gauges())[0] == {("busy", S.ENQUEUED): 1, ("busy", S.CANCELLED): 2}
    await _agree(pg_store)
