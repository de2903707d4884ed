"""A page's reads run at once on Postgres and one after the other on SQLite, and a failed read
surfaces as itself (the api's error handlers still map it), with the other reads stopped."""

from __future__ import annotations

import asyncio
from datetime import datetime

import pytest

from jobplane.errors import JobNotFoundError
from jobplane.store.sql import SqlStore
from jobplane_api.dashboard.reads import READS_AT_ONCE, PageReads


class InFlight:
    """Counts the store reads running at the same time."""

    def __init__(self, store: SqlStore) -> None:
        self.store = store
        self.now = 0
        self.most = 0

    async def read(self) -> datetime:
        self.now += 1
        self.most = max(self.most, self.now)
        try:
            await asyncio.sleep(0.01)  # still running when the next read is started
            return await self.store.now()
        finally:
            self.now -= 1


async def test_reads_overlap_only_where_the_store_runs_them_at_once(store: SqlStore) -> None:
    tracked = InFlight(store)
    async with PageReads(store) as reads:
        tasks = [reads.read(tracked.read) for _ in range(READS_AT_ONCE + 2)]
    assert all(isinstance(t.result(), datetime) for t in tasks)
    assert tracked.most == (READS_AT_ONCE if store.concurrent_reads else 1)
    assert store.concurrent_reads is (store.engine.dialect.name == "postgresql")


async def test_composed_work_awaits_reads_of_the_same_page(store: SqlStore) -> None:
    async def twice(reads: PageReads) -> list[datetime]:
        first, second = reads.read(store.now), reads.read(store.now)
        return [await first, await second]

    async with PageReads(store) as reads:
        # Composed work holds no turn: on SQLite (one turn) its reads still run.
        both = reads.compose(twice, reads)
        alone = reads.read(store.now)
    assert len(both.result()) == 2
    assert isinstance(alone.result(), datetime)


async def test_a_failed_read_is_raised_as_itself_and_stops_the_others(store: SqlStore) -> None:
    never_ended: list[str] = []

    async def slow() -> None:
        await asyncio.sleep(30)
        never_ended.append("slow")

    with pytest.raises(JobNotFoundError, match="missing"):
        async with PageReads(store) as reads:
            reads.compose(slow)
            reads.read(store.now)
            reads.read(store.get_definition, "missing")
    assert never_ended == []
