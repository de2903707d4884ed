"""The instance counters (migration 0017) agree with the rows, on Postgres and SQLite, after
inserts, claims, ends, retries, cancels, skips and retention deletes."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from sqlalchemy import func, select

from jobplane.domain.models import ErrorInfo, Outcome
from jobplane.domain.states import InstanceState as S
from jobplane.store.sql import SqlStore
from jobplane.store.tables import job_instances
from tests.store_helpers import define, enqueue

T = job_instances.c


async def _counted(store: SqlStore, key: str | None = None) -> dict[S, int]:
    query = select(T.state, func.count()).group_by(T.state)
    if key is not None:
        query = query.where(T.job_key == key)
    async with store.engine.connect() as conn:
        return {S(state): n for state, n in await conn.execute(query)}


async def _agree(store: SqlStore) -> dict[S, int]:
    counts = await store.count_by_state()
    assert counts == await _counted(store)
    for key in ("busy", "quiet"):
        assert await store.count_by_state(key) == await _counted(store, key)
    both = await store.count_by_state(job_keys=["busy", "quiet"])
    assert both == counts
    return counts


async def test_counters_follow_every_change(store: SqlStore) -> None:
    await define(store, "busy", max_concurrency=3, retries=1)
    await define(store, "quiet")
    assert await store.count_by_state() == {}
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
