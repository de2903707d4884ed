"""A worker frozen while a statement of its own was active keeps that statement's locks: no
idle limit ends an active session. The leader ends such sessions of the workers it marks dead,
before marking them, so neither the marking nor the claims of the worker's jobs wait on them
for as long as the process stays frozen (Postgres; real sessions)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import psycopg
import pytest
from sqlalchemy import text

from jobplane.domain.models import WorkerInfo
from jobplane.settings import CommonSettings
from jobplane.store.factory import open_store
from jobplane.store.sql import SqlStore
from jobplane_scheduler.settings import SchedulerSettings
from jobplane_worker.settings import WorkerSettings

pytestmark = pytest.mark.timeout(60)


def _dsn(url: str) -> str:
    return url.replace("postgresql+asyncpg://", "postgresql://")


@pytest.fixture
async def leader_store(pg_database_url: str) -> AsyncIterator[SqlStore]:
    """The store as a role opens it: a lock wait ends after half a second (then a conflict,
    retried a few times), so a write blocked by a frozen session fails instead of hanging."""
    limits = replace(
        WorkerSettings(lease_s=1.0, heartbeat_s=0.2).session_limits(), application_name="leader"
    )
    store = open_store(pg_database_url, limits=limits)
    yield store
    await store.close()


async def _frozen_worker_session(
    url: str, worker_id: str
) -> tuple[psycopg.AsyncConnection[Any], asyncio.Task[Any]]:
    """A session of ``worker_id`` (its ``application_name``, as a worker's sessions carry it)
    holding its worker row's lock in a statement still active: as a heartbeat or a claim whose
    worker froze right after its driver's Parse (the server then waits for the Bind)."""
    conn = await psycopg.AsyncConnection.connect(_dsn(url), application_name=worker_id)
    await conn.execute("SELECT id FROM workers WHERE id = %s FOR UPDATE", (worker_id,))
    running = asyncio.ensure_future(conn.execute("SELECT pg_sleep(50)"))
    await asyncio.sleep(0.2)  # the statement is under way
    return conn, running


async def _silent(store: SqlStore, worker_id: str, seconds: float) -> None:
    async with store.engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE workers SET heartbeat_at = now() - make_interval(secs => :s) WHERE id = :id"
            ),
            {"s": seconds, "id": worker_id},
        )


async def test_a_dead_worker_s_active_session_is_ended_before_it_is_marked(
    leader_store: SqlStore, pg_database_url: str
) -> None:
    await leader_store.register_worker(WorkerInfo("w-frozen", "h", 1, ("default",), 4, "1"))
    await _silent(leader_store, "w-frozen", 120)  # (its last heartbeat, before it froze)
    conn, running = await _frozen_worker_session(pg_database_url, "w-frozen")
    try:
        # Without the end of that session, the marking waits on the worker's row until its
        # lock timeout, every try, for as long as the process stays frozen.
        assert await leader_store.mark_dead_workers(60) == ["w-frozen"]
        with pytest.raises(psycopg.OperationalError):
            await running  # its transaction is gone, with nothing written
    finally:
        await conn.close()


async def test_a_live_worker_s_sessions_are_never_ended(
    leader_store: SqlStore, pg_database_url: str
) -> None:
    # The same session, but the worker's heartbeat is recent: it is not marked, and its
    # statement goes on.
    await leader_store.register_worker(WorkerInfo("w-alive", "h", 1, ("default",), 4, "1"))
    conn, running = await _frozen_worker_session(pg_database_url, "w-alive")
    try:
        assert await leader_store.mark_dead_workers(60) == []
        await asyncio.sleep(0.2)
        assert not running.done()
        running.cancel()
    finally:
        await conn.close()


def test_a_worker_s_and_a_scheduler_s_sessions_carry_their_ids() -> None:
    # What the sessions are found by; the api's have no id to be found by.
    assert WorkerSettings(worker_id="w-1").session_limits().application_name == "w-1"
    assert SchedulerSettings(scheduler_id="h:1").session_limits().application_name == "h:1"
    assert CommonSettings().session_limits().application_name is None
