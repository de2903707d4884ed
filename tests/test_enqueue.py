"""In-transaction enqueue on Postgres: the instance exists if and only if the caller commits,
and the scheduler publishes it shortly after."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from datetime import timedelta
from uuid import UUID

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine

from jobplane.bus.abc import Bus
from jobplane.dispatch import Dispatcher, InvalidArgumentsError, JobDisabledError
from jobplane.domain.models import InstanceFilter
from jobplane.domain.options import JobOptions
from jobplane.domain.states import InstanceState as S
from jobplane.enqueue import enqueue, enqueue_async
from jobplane.errors import IdempotencyConflictError, InvalidOptionsError, JobNotFoundError
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
    async with _leader_with_the_sweep_a_minute_away(store, redis_bus, database_url) as engine:
        await asyncio.sleep(0.5)  # the first sweep is done; the listener is up
        async with AsyncSession(engine) as session, session.begin():
            made = await enqueue_async(session, "echo", {"value": 3})
        await wait_for(lambda: _published(store, made), timeout_s=10, what="the publication")
        await _enqueue_rolled_back(engine, 4)
    assert await _count(store) == 1


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
async def test_the_leader_says_when_its_notifications_are_cut_and_listens_again(
    store: SqlStore, redis_bus: Bus, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The listening connection dies (a restart, a proxy): one warning names the outage, the
    leader listens again on a new connection, and the next commit's NOTIFY still gets its
    instance published at once (the sweep is a minute away); an info line says it is back."""
    caplog.set_level(logging.INFO, logger="jobplane.events")
    async with _leader_with_the_sweep_a_minute_away(store, redis_bus, database_url) as engine:
        first = await _wait_listening(store, set())
        await _run(store, f"SELECT pg_terminate_backend({first})")
        await _wait_listening(store, {first})
        async with AsyncSession(engine) as session, session.begin():
            made = await enqueue_async(session, "echo", {"value": 5})
        await wait_for(lambda: _published(store, made), timeout_s=10, what="the publication")
    lines = [(r.action, r.getMessage()) for r in caplog.records if hasattr(r, "action")]
    cut = [m for a, m in lines if a == "scheduler.events"]
    assert len(cut) == 1 and "enqueued notifications: the database is unavailable" in cut[0]
    assert any(a == "scheduler.events_restored" for a, _ in lines)


@contextlib.asynccontextmanager
async def _leader_with_the_sweep_a_minute_away(
    store: SqlStore, bus: Bus, database_url: str
) -> AsyncIterator[AsyncEngine]:
    """A leading scheduler whose sweep is a minute away (only a NOTIFY publishes in time),
    the job definitions registered, and an engine of the application's own."""
    async with running_worker(app, store, bus):
        pass
    engine = create_async_engine(make_url(database_url).set(drivername="postgresql+asyncpg"))
    try:
        async with running_scheduler(store, bus, sweep_interval_s=60) as scheduler:
            await wait_for(lambda: _leading(scheduler), what="leadership")
            yield engine
    finally:
        await engine.dispose()


async def _wait_listening(store: SqlStore, not_these: set[int]) -> int:
    """The pid of the backend the leader listens on, once it is none of ``not_these``."""
    found: list[int] = []

    async def listening() -> bool:
        pids = await _run(
            store,
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND query LIKE 'LISTEN%'",
        )
        found[:] = [p for p in pids if p not in not_these]
        return bool(found)

    await wait_for(listening, timeout_s=10, what="a listening connection")
    return found[0]


async def _run(store: SqlStore, sql: str) -> list[int]:
    async with store.engine.begin() as conn:
        return [int(v) for v in (await conn.execute(text(sql))).scalars()]


async def _enqueue_rolled_back(engine: AsyncEngine, value: int) -> None:
    async with AsyncSession(engine) as session:
        await session.begin()
        await enqueue_async(session, "echo", {"value": value})
        await session.rollback()


async def _leading(scheduler: Scheduler) -> bool:
    return scheduler.lease is not None


async def _published(store: SqlStore, instance_id: UUID) -> bool:
    return (await store.get_instance(instance_id)).published_at is not None


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
async def test_refuses_a_disabled_job_and_delays_on_the_database_clock(
    store: SqlStore, redis_bus: Bus, sync_url: str
) -> None:
    async with running_worker(app, store, redis_bus):
        pass
    engine = create_engine(sync_url)
    try:
        with engine.begin() as conn:
            # now() is the transaction's start: the instance's created_at is exactly it.
            db_now = conn.execute(text("SELECT now()")).scalar_one()
            delayed = enqueue(conn, "echo", {"value": 1}, delay=timedelta(minutes=10))
            at = enqueue(conn, "echo", {"value": 2}, run_at=db_now + timedelta(hours=1))
        with engine.begin() as conn, pytest.raises(InvalidOptionsError):
            enqueue(conn, "echo", {"value": 1}, run_at=db_now, delay=timedelta(seconds=1))
        # Out of range, a priority was stored and stopped every leader that published it;
        # a billion days' delay raised OverflowError.
        for bad in ({"priority": 99}, {"priority": -1}, {"priority": True}):
            with engine.begin() as conn, pytest.raises(InvalidOptionsError) as refused:
                enqueue(conn, "echo", {"value": 1}, **bad)
            assert refused.value.field == "priority"
        with engine.begin() as conn, pytest.raises(InvalidOptionsError) as refused:
            enqueue(conn, "echo", {"value": 1}, delay=timedelta(days=999_999_999))
        assert refused.value.field == "delay"
        definition = await store.get_definition("echo")
        disabled = definition.options.edited(disabled=True)
        await store.save_definition(disabled, expected_version=definition.version, actor="t")
        with engine.begin() as conn, pytest.raises(JobDisabledError):
            enqueue(conn, "echo", {"value": 3})
    finally:
        engine.dispose()
    made = await store.get_instance(delayed)
    assert made.state is S.SCHEDULED and made.created_at == db_now
    assert made.run_at == db_now + timedelta(minutes=10)
    assert (await store.get_instance(at)).run_at == db_now + timedelta(hours=1)
    assert await _count(store) == 2


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
async def test_idempotency_key_replays_and_conflicts(
    store: SqlStore, redis_bus: Bus, sync_url: str, database_url: str
) -> None:
    async with running_worker(app, store, redis_bus):
        pass
    engine = create_engine(sync_url)
    try:
        with engine.begin() as conn:
            first = enqueue(
                conn, "echo", {"value": 1}, delay=timedelta(hours=1), idempotency_key="o-1"
            )
        with engine.begin() as conn:
            again = enqueue(
                conn, "echo", {"value": 1}, delay=timedelta(hours=1), idempotency_key="o-1"
            )
        assert again == first
        for kwargs in ({"args": {"value": 2}}, {"args": {"value": 1}, "priority": 1}):
            with engine.begin() as conn, pytest.raises(IdempotencyConflictError) as info:
                enqueue(conn, "echo", idempotency_key="o-1", delay=timedelta(hours=1), **kwargs)
            assert info.value.key == "o-1"
        with engine.begin() as conn, pytest.raises(IdempotencyConflictError):
            enqueue(conn, "always_fails", idempotency_key="o-1")  # another job
    finally:
        engine.dispose()
    async_engine = create_async_engine(make_url(database_url).set(drivername="postgresql+asyncpg"))
    try:
        async with AsyncSession(async_engine) as session, session.begin():
            replay = await enqueue_async(
                session, "echo", {"value": 1}, delay=timedelta(hours=1), idempotency_key="o-1"
            )
            with pytest.raises(IdempotencyConflictError):
                await enqueue_async(session, "echo", {"value": 9}, idempotency_key="o-1")
    finally:
        await async_engine.dispose()
    assert replay == first
    # The same key through the store (as REST does) is the same request.
    dispatcher = Dispatcher(store, redis_bus)
    same = await dispatcher.trigger(
        "echo", {"value": 1}, delay=timedelta(hours=1), idempotency_key="o-1"
    )
    assert same.id == first
    assert await _count(store) == 1
    assert len(await store.transitions(first)) == 1


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
async def test_hold_debug_mode_holds_enqueued_triggered_jobs(
    store: SqlStore, redis_bus: Bus, sync_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JOBPLANE_DEBUG_HOLD_TRIGGERED", "true")
    engine = create_engine(sync_url)
    try:
        async with (
            running_worker(app, store, redis_bus),
            running_scheduler(store, redis_bus) as scheduler,
        ):
            await wait_for(lambda: _leading(scheduler), what="a leader listening for commits")
            with engine.begin() as conn:  # the leader is notified of what it must publish
                held = enqueue(conn, "echo", {"value": 1}, delay=timedelta(seconds=1))
                given = enqueue(conn, "echo", {"value": 2}, hold=False)  # the caller decides
            [done] = await settled(store, [given], timeout_s=30)
            assert done.state is S.SUCCEEDED
            await asyncio.sleep(1.5)  # past the delay: a held instance has no due time
            waiting = await store.get_instance(held)
            assert waiting.state is S.SCHEDULED and waiting.run_at is None
            await Dispatcher(store, redis_bus).run_now(held, "test")
            [ran] = await settled(store, [held], timeout_s=30)
        # Only triggered jobs are held: a recurring job enqueued is a run by hand.
        nightly = JobOptions.parse(key="nightly", kind="recurring", cron="0 3 * * *")
        await store.register_definition(nightly, None, "test")
        with engine.begin() as conn:
            by_hand = enqueue(conn, "nightly", hold=True)
        assert (await store.get_instance(by_hand)).state is S.ENQUEUED
    finally:
        engine.dispose()
    assert ran.state is S.SUCCEEDED and ran.result["value"] == 1
    assert [t.to_state for t in await store.transitions(held)] == [
        S.SCHEDULED,
        S.ENQUEUED,
        S.PROCESSING,
        S.SUCCEEDED,
    ]


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
async def test_a_replay_after_the_job_was_disabled_returns_the_first_instance(
    store: SqlStore, redis_bus: Bus, sync_url: str, database_url: str
) -> None:
    """An application retries a transaction whose commit's answer was lost; meanwhile the job
    was disabled. Its replay raised JobDisabledError for a request that had succeeded, where
    the REST trigger answers the first instance."""
    async with running_worker(app, store, redis_bus):
        pass
    engine = create_engine(sync_url)
    async_engine = create_async_engine(make_url(database_url).set(drivername="postgresql+asyncpg"))
    try:
        with engine.begin() as conn:
            first = enqueue(conn, "echo", {"value": 7}, idempotency_key="order-7")
        definition = await store.get_definition("echo")
        disabled = definition.options.edited(disabled=True)
        await store.save_definition(disabled, expected_version=definition.version, actor="t")
        with engine.begin() as conn:
            assert enqueue(conn, "echo", {"value": 7}, idempotency_key="order-7") == first
        async with AsyncSession(async_engine) as session, session.begin():
            replay = await enqueue_async(session, "echo", {"value": 7}, idempotency_key="order-7")
        assert replay == first
        with engine.begin() as conn, pytest.raises(JobDisabledError):
            enqueue(conn, "echo", {"value": 7}, idempotency_key="order-8")  # a new request
        with engine.begin() as conn, pytest.raises(JobDisabledError):
            enqueue(conn, "echo", {"value": 7})
    finally:
        engine.dispose()
        await async_engine.dispose()
    assert await _count(store) == 1
