"""The Postgres LISTEN path under a dying connection: stopping the listener never raises
anything but the cancellation (or the outage it reports), and never returns a listening
connection to the pool."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from sqlalchemy import text

from jobplane.errors import StoreUnavailableError
from jobplane.store.postgres import PostgresStore
from jobplane.store.sql import SqlStore

CHANNEL = "jobplane_test_channel"


async def _listen(store: PostgresStore, got: asyncio.Queue[list[str]]) -> None:
    async for batch in store.notifications(CHANNEL):
        await got.put(batch)


async def _notify(store: SqlStore, payload: str) -> None:
    async with store.engine.begin() as conn:
        await conn.execute(text("SELECT pg_notify(:c, :p)"), {"c": CHANNEL, "p": payload})


async def _terminate_listeners(store: SqlStore) -> int:
    async with store.engine.begin() as conn:
        result = await conn.execute(
            text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                "AND query LIKE 'LISTEN%'"
            )
        )
        return int(result.scalar_one())


async def _listening(store: SqlStore) -> int:
    async with store.engine.begin() as conn:
        result = await conn.execute(
            text("SELECT count(*) FROM pg_listening_channels() c WHERE c = :c"), {"c": CHANNEL}
        )
        return int(result.scalar_one())


@pytest.mark.parametrize("yields", [0, 1, 2, 3, 5, 8])
async def test_a_listener_cancelled_while_its_backend_dies_ends_cleanly(
    pg_store: SqlStore, yields: int
) -> None:
    # The race: the server ends the backend (a restart, pg_terminate_backend) and the task is
    # cancelled before the client has seen the socket close. Its UNLISTEN then meets a protocol
    # still consuming the server's FATAL error and asyncpg raises InternalClientError, which
    # used to replace the CancelledError and stop the scheduler's leader duties.
    assert isinstance(pg_store, PostgresStore)
    for attempt in range(10):
        got: asyncio.Queue[list[str]] = asyncio.Queue()
        task = asyncio.create_task(_listen(pg_store, got))
        await _notify(pg_store, f"hello {attempt}")  # may be sent before LISTEN: retry
        while got.empty():
            await asyncio.sleep(0.01)
            await _notify(pg_store, f"hello {attempt}")
        assert await _terminate_listeners(pg_store) == 1
        for _ in range(yields + attempt % 3):
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, StoreUnavailableError):
            await task  # anything else propagates and fails the test
    # Every connection the pool still holds answers, and none of them is listening.
    assert await _listening(pg_store) == 0
