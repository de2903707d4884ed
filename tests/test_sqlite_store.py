"""The embedded SQLite store under cancellation: a connection closed mid-transaction never
keeps the file's write lock."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

from sqlalchemy import text

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
