"""The embedded SQLite store's file lock: a connection closed mid-transaction never keeps it,
and one another connection holds past the busy timeout is an outage."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import text

from jobplane.domain.models import WorkerInfo
from jobplane.errors import StoreUnavailableError
from jobplane.store import sqlite
from jobplane.store.factory import open_store
from jobplane.store.sql import SqlStore
from jobplane.store.sqlite import sqlite_engine


async def test_a_connection_closed_mid_transaction_releases_the_write_lock(
    tmp_path: Path,
) -> None:
    path = tmp_path / "lock.db"
    engine = sqlite_engine(f"sqlite+aiosqlite:///{path}")
    try:
        async with engine.begin() as conn:
            await conn.execute(text("CREATE TABLE t (n INTEGER)"))
            await conn.execute(text("INSERT INTO t VALUES (1), (2), (3)"))
        # What SQLAlchemy does when a task is cancelled mid-statement: the connection is closed
        # inside its transaction while a cursor of it is still referenced (by the traceback).
        raw = await engine.raw_connection()
        driver = raw.driver_connection  # aiosqlite's connection, over the sqlite3 one
        assert driver is not None
        sqlite_conn = driver._connection
        kept: list[sqlite3.Cursor] = []

        def begin_and_leave_a_cursor_open() -> None:
            sqlite_conn.execute("BEGIN IMMEDIATE")
            cursor = sqlite_conn.execute("SELECT n FROM t")
            cursor.fetchone()  # a statement still stepping: close() cannot finalise it
            kept.append(cursor)

        await asyncio.to_thread(begin_and_leave_a_cursor_open)
        raw.invalidate()

        # Another connection (another process, say) takes the write lock at once.
        other = sqlite3.connect(path, timeout=0.5, isolation_level=None)
        started = time.monotonic()
        other.execute("BEGIN IMMEDIATE")
        other.execute("ROLLBACK")
        other.close()
        assert time.monotonic() - started < 0.5
        assert kept  # the cursor is still alive: the lock was released by the rollback
    finally:
        await engine.dispose()


async def test_a_file_locked_past_the_busy_timeout_is_an_outage_not_a_refusal(
    sqlite_database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another connection (the application's transaction around enqueue(), a shell, a VACUUM)
    holds the file's write lock past the busy timeout. "database is locked" was taken for a
    refusal of the data: an outcome was recorded as not stored, and the heartbeat and the
    leader's campaign ended their roles. It is waited out as an outage."""
    async with _locked(sqlite_database_url, monkeypatch, busy_ms=200) as store:
        with pytest.raises(StoreUnavailableError, match="database is locked"):
            await store.worker_heartbeat("w1")


async def test_transactions_queued_behind_a_locked_file_wait_the_busy_timeout_at_most(
    sqlite_database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While another connection holds the file's lock, each of this process's transactions
    waited out the busy timeout in its BEGIN, one after another: one queued behind a role's
    few waited for all of them (an API request answered after 148 s for a lock of 150 s).
    Waiting for its turn is bounded by the busy timeout too: an outage, said within twice
    the timeout, whatever the queue."""
    loop = asyncio.get_running_loop()
    async with _locked(sqlite_database_url, monkeypatch, busy_ms=400) as store:

        async def heartbeat() -> float:
            with pytest.raises(StoreUnavailableError, match="database is locked"):
                await store.worker_heartbeat("w1")
            return loop.time() - began

        began = loop.time()
        waited = await asyncio.gather(*(heartbeat() for _ in range(6)))
        assert max(waited) < 2 * 0.4 + 0.3, waited  # (unbounded: 6 x 0.4 s, the last 2.4 s)


async def test_a_transaction_asking_just_after_a_release_waits_the_busy_timeout_at_most(
    sqlite_database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Just after a release the turn lock reads free while the waiter it woke has not run
    yet: a transaction asking then took it as free, queued without a bound behind everyone,
    and waited 0.81, 1.23 and 1.67 s for a busy timeout of 0.4 s."""
    loop = asyncio.get_running_loop()
    go = asyncio.Event()
    async with _locked(sqlite_database_url, monkeypatch, busy_ms=400) as store:

        async def heartbeat(after: asyncio.Event | None = None) -> float:
            if after is not None:
                await after.wait()
            began = loop.time()
            with pytest.raises(StoreUnavailableError):
                await store.worker_heartbeat("w1")
            return loop.time() - began

        assert isinstance(store, sqlite.SqliteStore)
        release = store._turns.release

        def release_and_ask() -> None:
            go.set()  # these ask in the loop turn of the release, before the woken waiter runs
            release()

        asking = [asyncio.create_task(heartbeat(go)) for _ in range(3)]
        monkeypatch.setattr(store._turns, "release", release_and_ask)

        async def queued() -> float:
            await asyncio.sleep(0.1)  # waiting for its turn when the first one gives it up
            return await heartbeat()

        await asyncio.gather(heartbeat(), queued())
        waited = await asyncio.gather(*asking)
        assert max(waited) < 2 * 0.4 + 0.3, waited


@contextlib.asynccontextmanager
async def _locked(
    url: str, monkeypatch: pytest.MonkeyPatch, *, busy_ms: int
) -> AsyncIterator[SqlStore]:
    """A store on ``url`` (busy timeout ``busy_ms``), worker w1 registered, while another
    connection holds the file's write lock; once it lets go, the store works again."""
    monkeypatch.setattr(sqlite, "BUSY_TIMEOUT_MS", busy_ms)
    store = open_store(url)
    holder = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
    try:
        await store.register_worker(_worker("w1"))
        holder.execute("BEGIN IMMEDIATE")
        yield store
        holder.execute("ROLLBACK")
        assert await store.worker_heartbeat("w1")
    finally:
        holder.close()
        await store.close()


def _worker(worker_id: str) -> WorkerInfo:
    return WorkerInfo(
        id=worker_id, host="h", pid=1, queues=("default",), capacity=1, version="0", jobs=()
    )


async def test_a_process_s_transactions_on_the_file_take_turns_in_the_order_asked(
    sqlite_database_url: str,
) -> None:
    """Every transaction takes the file's write lock at its start; SQLite lets the ones that
    find it taken sleep and retry, so under a stream of writes one could wait for seconds
    (the leader's lease renewal behind a busy worker lost its term). A process's own
    transactions queue instead, first come, first served."""
    store = open_store(sqlite_database_url)
    try:
        workers = [f"w{i}" for i in range(40)]
        for worker_id in workers:
            await store.register_worker(_worker(worker_id))
        done: list[str] = []

        async def beat(worker_id: str) -> None:
            assert await store.worker_heartbeat(worker_id)
            done.append(worker_id)

        await asyncio.gather(*(beat(w) for w in workers))
        assert done == workers
    finally:
        await store.close()
