"""Races over many real database connections (Postgres and SQLite).

Each claimer is a separate store with its own connection pool, so the claims really run at the
same time in the database; the invariants are checked from the rows and the history afterwards.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from jobplane.domain.models import InstanceFilter, Outcome
from jobplane.domain.states import InstanceState as S
from jobplane.store.factory import open_store
from jobplane.store.sql import SqlStore
from tests.store_helpers import define, enqueue, max_running

pytestmark = pytest.mark.timeout(300)

CLAIMERS = 50
RACERS = 200
CONNECTIONS = 20


async def _stores(url: str, n: int) -> list[SqlStore]:
    stores = [open_store(url, pool_size=1) for _ in range(n)]
    await asyncio.gather(*(s.ping() for s in stores))
    return stores


async def test_fifty_claimers_on_one_instance_exactly_one_wins(
    store: SqlStore, database_url: str
) -> None:
    await define(store, "job", max_concurrency=100)
    [inst] = await enqueue(store)
    stores = await _stores(database_url, CLAIMERS)
    try:
        gate = asyncio.Event()

        async def claimer(i: int, s: SqlStore) -> int:
            await gate.wait()
            result = await s.claim([inst.id], f"w{i}", 10, ["job"])
            return len(result.claimed)

        tasks = [asyncio.create_task(claimer(i, s)) for i, s in enumerate(stores)]
        gate.set()
        wins = await asyncio.gather(*tasks)
    finally:
        await asyncio.gather(*(s.close() for s in stores))
    assert sum(wins) == 1
    history = await store.transitions(inst.id)
    assert [t.to_state for t in history] == [S.ENQUEUED, S.PROCESSING]


async def _race(store: SqlStore, url: str, on_limit: str) -> dict[str, list[bool]]:
    """200 instances of a max-concurrency-3 job, each claimed by its own racer; winners run
    briefly and complete, so slots are taken and given back while the race goes on."""
    await define(store, "job", max_concurrency=3, on_limit=on_limit)
    instances = await enqueue(store, n=RACERS)
    stores = await _stores(url, CONNECTIONS)
    outcomes: dict[str, list[bool]] = {"won": [], "lost": []}
    try:
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(RACERS):
            queue.put_nowait(i)

        async def racer(s: SqlStore) -> None:
            while not queue.empty():
                inst = instances[queue.get_nowait()]
                result = await s.claim([inst.id], "w", 10, ["job"])
                if result.claimed:
                    outcomes["won"].append(True)
                    await asyncio.sleep(random.uniform(0, 0.01))
                    await s.complete([Outcome(inst.id, result.claimed[0].token, S.SUCCEEDED)])
                else:
                    outcomes["lost"].append(True)

        await asyncio.gather(*(racer(s) for s in stores))
    finally:
        await asyncio.gather(*(s.close() for s in stores))
    return outcomes


async def _all_history(store: SqlStore) -> list[tuple[int, S | None, S]]:
    ids = [i.id for i in (await store.list_instances(InstanceFilter(), limit=10_000)).items]
    out: list[tuple[int, S | None, S]] = []
    for instance_id in ids:
        out.extend((t.seq, t.from_state, t.to_state) for t in await store.transitions(instance_id))
    return out


async def test_two_hundred_racing_claims_never_exceed_max_concurrency(
    store: SqlStore, database_url: str
) -> None:
    outcomes = await _race(store, database_url, "skip")
    counts = await store.count_by_state("job")
    assert max_running(await _all_history(store)) <= 3
    assert counts.get(S.PROCESSING, 0) == 0
    assert counts[S.SUCCEEDED] == len(outcomes["won"]) >= 3
    # Every loser was Skipped with the reason, none left in limbo.
    assert counts.get(S.SKIPPED, 0) == len(outcomes["lost"])
    assert counts[S.SUCCEEDED] + counts.get(S.SKIPPED, 0) == RACERS


async def test_racing_claims_with_on_limit_wait_leave_losers_queued(
    store: SqlStore, database_url: str
) -> None:
    outcomes = await _race(store, database_url, "wait")
    counts = await store.count_by_state("job")
    assert max_running(await _all_history(store)) <= 3
    assert counts.get(S.SKIPPED, 0) == 0
    assert counts.get(S.ENQUEUED, 0) == len(outcomes["lost"])
    # The queued losers are not lost: they can be republished and run.
    waiting = await store.republish_waiting(["job"], RACERS)
    assert len(waiting) == len(outcomes["lost"])
