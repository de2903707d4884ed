"""The embedded SQLite store's announcements: an instance made Scheduled is announced with its
run_at to listeners in the same process when its transaction commits, as Postgres's trigger
NOTIFYs it (migration 0023), so that the leader of ``jobplane dev`` wakes for a short delay or
a retry's backoff instead of waiting for its next sweep."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.pool import QueuePool

from jobplane.domain.models import Instance, NewInstance
from jobplane.domain.states import InstanceState as S
from jobplane.store.creation import DUE_PREFIX, ENQUEUED_CHANNEL
from jobplane.store.factory import make_engine, open_store
from jobplane.store.migrate import upgrade
from jobplane.store.sql import SqlStore
from jobplane.store.sqlite import DUE_FUNCTION, SqliteStore
from tests.store_helpers import define


@asynccontextmanager
async def _listening(store: SqlStore) -> AsyncIterator[asyncio.Queue[list[str]]]:
    """Batches heard on the leader's channel, in a queue, while the block runs."""
    heard: asyncio.Queue[list[str]] = asyncio.Queue()

    async def listen() -> None:
        async for batch in store.notifications(ENQUEUED_CHANNEL):
            await heard.put(batch)

    task = asyncio.create_task(listen())
    await asyncio.sleep(0)  # (registered before the block writes anything)
    try:
        yield heard
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.fixture
async def job_store(sqlite_database_url: str) -> AsyncIterator[SqlStore]:
    """The SQLite store of this test's file, with the job ``job`` defined."""
    store = open_store(sqlite_database_url)
    try:
        await define(store, "job")
        yield store
    finally:
        await store.close()


async def _next_epochs(heard: asyncio.Queue[list[str]]) -> list[float]:
    """The due times of the next batch heard (within 5 s)."""
    return _epochs(await asyncio.wait_for(heard.get(), 5))


def _due(instance: Instance) -> float:
    assert instance.run_at is not None
    return instance.run_at.timestamp()


def _epochs(batch: list[str]) -> list[float]:
    assert all(p.startswith(DUE_PREFIX) for p in batch), batch
    return [float(p.removeprefix(DUE_PREFIX)) for p in batch]


async def _delayed(store: SqlStore, seconds: float = 60) -> Instance:
    [made] = await store.create_instances(
        [NewInstance(job_key="job", run_at=await store.now() + timedelta(seconds=seconds))]
    )
    assert made.state is S.SCHEDULED
    return made


async def test_an_instance_made_scheduled_is_announced_with_its_run_at_on_commit(
    job_store: SqlStore,
) -> None:
    async with _listening(job_store) as heard:
        [now] = await job_store.create_instances([NewInstance(job_key="job")])
        assert now.state is S.ENQUEUED  # not announced: nothing to wait for
        later = await _delayed(job_store)
        assert await _next_epochs(heard) == [_due(later)]
        assert heard.empty()


async def test_a_transaction_rolled_back_announces_nothing(job_store: SqlStore) -> None:
    first = await _delayed(job_store, 60)
    async with _listening(job_store) as heard:
        # A new run_at for a Scheduled row fires the update trigger; the rollback drops it.
        async with job_store.engine.connect() as conn:
            await conn.execute(
                text("UPDATE job_instances SET run_at = datetime('now') WHERE id = :id"),
                {"id": first.id.hex},
            )
            await conn.rollback()
        second = await _delayed(job_store, 120)
        assert await _next_epochs(heard) == [_due(second)]
        assert (await job_store.get_instance(first.id)).run_at == first.run_at
    _one_connection(job_store)  # so the rolled-back one also made the write after it


async def test_a_connection_opened_before_the_schema_announces_once_it_exists(
    tmp_path: Path,
) -> None:
    # A role may open its store on a file not migrated yet (it waits for the schema): the
    # connection it opened then, reused after the migration, still announces.
    url = f"sqlite:///{tmp_path / 'late.db'}"
    store = open_store(url)
    try:
        await store.ping()  # the pool's first connection, opened on an empty file
        assert await store.schema_revision() is None
        engine = make_engine(url)
        try:
            await upgrade(engine)
        finally:
            await engine.dispose()
        await define(store, "job")
        async with _listening(store) as heard:
            later = await _delayed(store)
            assert await _next_epochs(heard) == [_due(later)]
        _one_connection(store)  # (the one opened before the schema)
    finally:
        await store.close()


def _one_connection(store: SqlStore) -> None:
    """The store's calls, one after another, all ran on the one connection its pool opened."""
    pool = store.engine.pool
    assert isinstance(pool, QueuePool)
    assert (pool.checkedin(), pool.checkedout(), pool.overflow()) == (1, 0, -pool.size() + 1)


async def test_instances_made_scheduled_for_the_same_moment_are_announced_once(
    job_store: SqlStore,
) -> None:
    # As Postgres delivers a transaction's identical NOTIFYs once: one wake for a batch.
    at = await job_store.now() + timedelta(seconds=60)
    async with _listening(job_store) as heard:
        made = await job_store.create_instances(
            [NewInstance(job_key="job", run_at=at) for _ in range(50)]
        )
        assert {i.state for i in made} == {S.SCHEDULED}
        assert await _next_epochs(heard) == [at.timestamp()]


async def test_an_unreadable_due_time_fails_no_write_and_is_logged(
    job_store: SqlStore, caplog: pytest.LogCaptureFixture
) -> None:
    # The function runs inside the statement that fired it: an error out of it would fail
    # that write. One it cannot read (nothing the store writes) is logged and skipped.
    async with _listening(job_store) as heard:
        async with job_store.engine.begin() as conn:
            await conn.execute(text(f"SELECT {DUE_FUNCTION}('not a time')"))
        later = await _delayed(job_store)
        assert await _next_epochs(heard) == [_due(later)]
    assert "could not read the run_at 'not a time'" in caplog.text


async def test_a_connection_pooled_before_the_store_gets_its_function_with_its_triggers(
    sqlite_database_url: str,
) -> None:
    # An engine used before the store was made on it: its pooled connection never saw the
    # store's "connect" listener. Triggers without their function would fail every write
    # that makes an instance Scheduled.
    engine = make_engine(sqlite_database_url)
    async with engine.connect() as conn:
        await conn.execute(text("SELECT 1"))
    store = SqliteStore(engine)
    try:
        await define(store, "job")
        async with _listening(store) as heard:
            later = await _delayed(store)
            assert await _next_epochs(heard) == [_due(later)]
    finally:
        await store.close()
