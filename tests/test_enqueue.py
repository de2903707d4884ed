"""In-transaction enqueue on Postgres: the instance exists if and only if the caller commits,
and the scheduler publishes it shortly after."""

from __future__ import annotations

import asyncio
from uuid import UUID

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine

from jobplane.bus.abc import Bus
from jobplane.dispatch import InvalidArgumentsError
from jobplane.domain.models import InstanceFilter
from jobplane.domain.states import InstanceState as S
from jobplane.enqueue import enqueue, enqueue_async
from jobplane.errors import JobNotFoundError
from jobplane.store.sql import SqlStore
from jobplane_scheduler.scheduler import Scheduler
from tests.apps.basic import app
from tests.scheduler_helpers import running_scheduler
from tests.worker_helpers import running_worker, settled, wait_for


@pytest.fixture
def sync_url(pg_database_url: str) -> str:
    return make_url(pg_database_url).set(drivername="postgresql+psycopg").render_as_string(False)


async def _count(store: SqlStore) -> int:
    return len((await store.list_instances(InstanceFilter(job_key="echo"))).items)


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
async def test_committed_runs_rolled_back_never_exists(
    store: SqlStore, redis_bus: Bus, sync_url: str
) -> None:
    async with running_worker(app, store, redis_bus):  # registers the definitions
        pass
    engine = create_engine(sync_url)
    try:
        with engine.begin() as conn:  # the application's own transaction
            conn.execute(text("CREATE TABLE orders (id int)"))
            conn.execute(text("INSERT INTO orders VALUES (1)"))
            kept = enqueue(conn, "echo", {"value": 1})
        with pytest.raises(RuntimeError), engine.begin() as conn:
            conn.execute(text("INSERT INTO orders VALUES (2)"))
            enqueue(conn, "echo", {"value": 2})
            raise RuntimeError("the application fails: everything rolls back")
        with engine.begin() as conn, pytest.raises(InvalidArgumentsError):
            enqueue(conn, "echo", {"value": "two"})
        with engine.begin() as conn, pytest.raises(JobNotFoundError):
            enqueue(conn, "nope")
    finally:
        engine.dispose()
    assert await _count(store) == 1
    async with running_worker(app, store, redis_bus), running_scheduler(store, redis_bus):
        [done] = await settled(store, [kept], timeout_s=30)
    assert done.state is S.SUCCEEDED and done.result["value"] == 1
    assert [t.to_state for t in await store.transitions(kept)][:2] == [S.ENQUEUED, S.PROCESSING]


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
async def test_async_session(store: SqlStore, redis_bus: Bus, database_url: str) -> None:
    async with running_worker(app, store, redis_bus):
        pass
    engine = create_async_engine(make_url(database_url).set(drivername="postgresql+asyncpg"))
    try:
        async with AsyncSession(engine) as session, session.begin():
            made = await enqueue_async(session, "echo", {"value": 7})
        await _enqueue_rolled_back(engine, 8)
    finally:
        await engine.dispose()
    assert await _count(store) == 1
    async with running_worker(app, store, redis_bus), running_scheduler(store, redis_bus):
        [done] = await settled(store, [made], timeout_s=30)
    assert done.state is S.SUCCEEDED


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
async def test_commit_notifies_the_leader_which_publishes_at_once(
    store: SqlStore, redis_bus: Bus, database_url: str
) -> None:
    """With the sweep a minute away, only the commit's NOTIFY can get the instance published;
    the rolled-back one notifies nothing."""
    async with running_worker(app, store, redis_bus):
        pass
    engine = create_async_engine(make_url(database_url).set(drivername="postgresql+asyncpg"))
    try:
        async with running_scheduler(store, redis_bus, sweep_interval_s=60) as scheduler:
            await wait_for(lambda: _leading(scheduler), what="leadership")
            await asyncio.sleep(0.5)  # the first sweep is done; the listener is up
            async with AsyncSession(engine) as session, session.begin():
                made = await enqueue_async(session, "echo", {"value": 3})
            await wait_for(lambda: _published(store, made), timeout_s=10, what="the publication")
            await _enqueue_rolled_back(engine, 4)
    finally:
        await engine.dispose()
    assert await _count(store) == 1


async def _enqueue_rolled_back(engine: AsyncEngine, value: int) -> None:
    async with AsyncSession(engine) as session:
        await session.begin()
        await enqueue_async(session, "echo", {"value": value})
        await session.rollback()


async def _leading(scheduler: Scheduler) -> bool:
    return scheduler.lease is not None


async def _published(store: SqlStore, instance_id: UUID) -> bool:
    return (await store.get_instance(instance_id)).published_at is not None
