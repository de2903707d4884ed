"""The store's asyncio engine (``jobplane.store.engine``), on real Postgres and SQLite: its
transactions, its connections' return to the pool when a task is cancelled, and that no role
imports SQLAlchemy's ORM with it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import InvalidRequestError

from jobplane.store.engine import AsyncEngine, create_async_engine
from jobplane.store.factory import make_engine


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    made = make_engine(database_url, pool_size=2)
    async with made.begin() as conn:
        await conn.execute(text("CREATE TABLE engine_probe (n INTEGER)"))
    yield made
    await made.dispose()


async def _rows(engine: AsyncEngine) -> list[int]:
    async with engine.connect() as conn:
        return list((await conn.scalars(text("SELECT n FROM engine_probe ORDER BY n"))).all())


async def test_a_transaction_commits_when_its_block_ends_and_rolls_back_when_it_raises(
    engine: AsyncEngine,
) -> None:
    async with engine.begin() as conn:
        await conn.execute(text("INSERT INTO engine_probe VALUES (:n)"), [{"n": 1}, {"n": 2}])
    with pytest.raises(ZeroDivisionError):
        async with engine.begin() as conn:
            await conn.execute(text("INSERT INTO engine_probe VALUES (3)"))
            1 / 0  # noqa: B018
    async with engine.connect() as conn:
        async with conn.begin():
            await conn.execute(text("INSERT INTO engine_probe VALUES (4)"))
        async with conn.begin():
            await conn.execute(text("INSERT INTO engine_probe VALUES (5)"))
            await conn.rollback()
    assert await _rows(engine) == [1, 2, 4]
    assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]


async def test_a_statement_after_a_commit_inside_a_transaction_block_is_refused(
    engine: AsyncEngine,
) -> None:
    """Not run in a transaction of its own that the block's end would leave uncommitted."""
    with pytest.raises(InvalidRequestError):
        async with engine.begin() as conn:
            await conn.execute(text("INSERT INTO engine_probe VALUES (1)"))
            await conn.commit()
            await conn.execute(text("INSERT INTO engine_probe VALUES (2)"))
    assert await _rows(engine) == [1]


async def test_a_result_s_driver_cursor_is_closed_when_execute_returns(
    engine: AsyncEngine,
) -> None:
    """Its rows are kept; the cursor itself is closed at once, as aiosqlite's close must be
    awaited in the greenlet (it would otherwise stay open until collected)."""
    async with engine.connect() as conn:
        result = await conn.execute(text("SELECT 1 UNION ALL SELECT 2"))
        driver_cursor = result.cursor._cursor  # the asyncio adapter's driver cursor
        if engine.dialect.name == "sqlite":
            with pytest.raises(Exception, match="closed"):
                await driver_cursor.fetchone()
        assert result.scalars().all() == [1, 2]


def test_an_engine_needs_an_asyncio_driver(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="pysqlite"):
        create_async_engine(f"sqlite:///{tmp_path / 'sync.db'}")


async def test_a_connection_goes_back_to_the_pool_when_its_task_is_cancelled_mid_statement(
    engine: AsyncEngine,
) -> None:
    """Cancelled inside a transaction, mid-statement: the transaction is rolled back and the
    connection returned (closed if it cannot be reused), the cancellation still raised."""
    started = asyncio.Event()
    sleep = "SELECT pg_sleep(30)" if engine.dialect.name == "postgresql" else None

    async def write_then_wait() -> None:
        async with engine.begin() as conn:
            await conn.execute(text("INSERT INTO engine_probe VALUES (7)"))
            started.set()
            if sleep is not None:
                await conn.execute(text(sleep))
            else:  # SQLite has no sleep: the block waits between two statements
                await asyncio.sleep(30)

    task = asyncio.create_task(write_then_wait())
    await asyncio.wait_for(started.wait(), 10)
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)
    assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    assert await _rows(engine) == []  # rolled back, and the pool serves again


async def test_run_sync_and_the_raw_connection_reach_the_same_session(
    engine: AsyncEngine,
) -> None:
    async with engine.begin() as conn:
        await conn.execute(text("INSERT INTO engine_probe VALUES (9)"))
        # A blocking call on the connection, in its transaction: it sees the row.
        seen = await conn.run_sync(
            lambda sync, sql: sync.execute(text(sql)).scalar_one(),
            "SELECT count(*) FROM engine_probe",
        )
        raw = await conn.get_raw_connection()
        assert raw.driver_connection is not None
    assert seen == 1
    assert conn.closed


def test_no_role_imports_sqlalchemy_s_orm() -> None:
    """Every role's modules and the store load without SQLAlchemy's ORM or its asyncio
    extension (6 to 7 MB of each role's idle memory)."""
    code = (
        "import sys, jobplane, jobplane.store.factory, jobplane_cli.main, jobplane_worker.main,"
        " jobplane_scheduler.main, jobplane_api.main;"
        " print(sorted(m for m in ('sqlalchemy.orm', 'sqlalchemy.ext.asyncio')"
        " if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]", out.stderr
