"""The single trigger's statement runs on asyncpg beneath SQLAlchemy (jobplane.store.driver):
its rows convert as SQLAlchemy's would, and its errors are SQLAlchemy's, so the store's error
handling (a refused value, a lost connection) is unchanged. Real Postgres."""

from __future__ import annotations

import asyncio
import socket
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest
from sqlalchemy import make_url, text
from sqlalchemy.exc import DBAPIError

from jobplane.domain.models import NewInstance
from jobplane.domain.states import InstanceState
from jobplane.errors import StoreRefusedError, StoreUnavailableError
from jobplane.idempotency import fingerprint
from jobplane.store.base import reachable
from jobplane.store.factory import open_store
from jobplane.store.sql import SqlStore
from tests.store_helpers import define


async def test_the_created_instance_reads_back_the_same(pg_store: SqlStore) -> None:
    await define(pg_store, "job", priority=2)
    definition = await pg_store.get_definition("job")
    run_at = datetime.now(UTC) + timedelta(hours=1)
    new = NewInstance(job_key="job", args={"n": [1, "x"]}, run_at=run_at, pinned_worker="w1")
    made = await pg_store.create_published(new, definition)
    assert made.id == new.id
    assert made.state is InstanceState.SCHEDULED
    assert made.run_at == run_at and made.run_at.tzinfo is UTC
    assert made.created_at.tzinfo is UTC
    assert made == await pg_store.get_instance(new.id)
    enqueued = await pg_store.create_published(NewInstance(job_key="job"), definition)
    assert enqueued.state is InstanceState.ENQUEUED and enqueued.published_at is not None
    assert enqueued == await pg_store.get_instance(enqueued.id)


async def test_a_value_the_database_refuses_is_a_refusal_with_its_sqlstate(
    pg_store: SqlStore,
) -> None:
    # The API answers SQLSTATE class 22 with a 422 (jobplane_api.problems): the store reports
    # the refusal with its SQLSTATE, translated from SQLAlchemy's DBAPIError as for the
    # store's other executions (chained: the driver's error is the cause).
    await define(pg_store, "job")
    definition = await pg_store.get_definition("job")
    with pytest.raises(StoreRefusedError) as refused:
        await pg_store.create_published(NewInstance(job_key="job", args="\x00"), definition)
    assert refused.value.sqlstate == "22P05"  # untranslatable character: jsonb has no NUL
    assert isinstance(refused.value.__cause__, DBAPIError)
    # The connection went back to the pool usable: the next triggers work.
    for _ in range(3):
        made = await pg_store.create_published(NewInstance(job_key="job"), definition)
        assert made.state is InstanceState.ENQUEUED


async def test_a_connection_lost_mid_statement_is_unavailable_then_replaced(
    pg_store: SqlStore,
) -> None:
    await define(pg_store, "job")
    definition = await pg_store.get_definition("job")
    print_ = fingerprint("job", None, run_at=None, priority=None, pinned_worker=None)
    first = NewInstance(job_key="job", idempotency_key="k", fingerprint=print_)
    second = NewInstance(job_key="job", idempotency_key="k", fingerprint=print_)
    async with pg_store.engine.connect() as holder:
        # An uncommitted insert of the same idempotency key: the trigger's insert waits on it.
        await holder.execute(
            text(
                "INSERT INTO job_instances (id, job_key, state, source, queue, priority, "
                "created_at, idempotency_key, idempotency_fingerprint) VALUES "
                "(:id, 'job', 'enqueued', 'trigger', 'default', 0, now(), 'k', :fp)"
            ),
            {"id": first.id, "fp": print_},
        )
        waiting = asyncio.create_task(pg_store.create_published(second, definition))
        pid = None
        for _ in range(200):
            pid = await _waiting_backend(pg_store)
            if pid is not None:
                break
            await asyncio.sleep(0.02)
        assert pid is not None, "the trigger never waited on the uncommitted insert"
        async with pg_store.engine.connect() as killer:
            await killer.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        with pytest.raises(StoreUnavailableError):
            await waiting
        await holder.rollback()
    # The broken connection was discarded, not pooled: the next trigger works.
    made = await pg_store.create_published(second, definition)
    assert made.id == second.id and made.state is InstanceState.ENQUEUED


async def _waiting_backend(store: SqlStore) -> int | None:
    """The backend waiting on a lock (pg_stat_activity is read in a transaction of its own:
    a transaction sees one snapshot of it)."""
    async with store.engine.connect() as conn:
        found = await conn.execute(
            text(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock'"
            )
        )
        pid = found.scalar()
    return None if pid is None else int(pid)


async def test_an_unreachable_database_is_unavailable(pg_store: SqlStore) -> None:
    await define(pg_store, "job")
    definition = await pg_store.get_definition("job")
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    unreachable = open_store(f"postgresql://postgres@127.0.0.1:{port}/nowhere")
    try:
        with pytest.raises(StoreUnavailableError):
            await unreachable.create_published(NewInstance(job_key="job"), definition)
    finally:
        await unreachable.close()


async def test_a_refused_connection_is_reported_as_by_sqlalchemy(
    pg_store: SqlStore, pg_database_url: str
) -> None:
    # The server refuses the session (no such database): the same refusal as a checkout
    # through engine.connect() gives, not the driver's own exception.
    await define(pg_store, "job")
    definition = await pg_store.get_definition("job")
    missing = make_url(pg_database_url).set(database="jobplane_no_such_database")
    refused = open_store(missing.render_as_string(hide_password=False))
    try:
        with pytest.raises(StoreRefusedError) as raised:
            await refused.create_published(NewInstance(job_key="job"), definition)
        assert raised.value.sqlstate == "3D000"  # invalid catalog name
    finally:
        await refused.close()


async def _out_of_step(store: SqlStore, type_name: str) -> int:
    """Make the pooled connection of ``store`` (a pool of one) raise asyncpg's
    ``InternalClientError`` when it reads a ``type_name`` value: the error asyncpg raises when
    its protocol is out of step ("cannot switch to state 15; another operation (2) is in
    progress", seen on a leader's connection after its process was frozen mid-statement).
    Returns the connection's backend pid."""

    def out_of_step(_value: str) -> None:
        raise asyncpg.InternalClientError(
            "cannot switch to state 15; another operation (2) is in progress"
        )

    async with store.engine.connect() as conn:
        driver: Any = (await conn.get_raw_connection()).driver_connection
        await driver.set_type_codec(
            type_name, schema="pg_catalog", encoder=str, decoder=out_of_step, format="text"
        )
        return int(driver.get_server_pid())


async def _backend_pid(store: SqlStore) -> int:
    async with store.engine.connect() as conn:
        return int((await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one())


async def test_a_connection_out_of_step_is_dropped_and_unavailable(pg_database_url: str) -> None:
    # Reported as a refusal of the statement and pooled as it was, it ended the leader's
    # duties; now it is a lost connection: waited out, and the next call gets a new one.
    store = open_store(pg_database_url, pool_size=1)
    try:
        broken = await _out_of_step(store, "circle")
        with pytest.raises(StoreUnavailableError, match="another operation"):
            async with reachable(), store.engine.connect() as conn:
                await conn.execute(text("SELECT circle '<(0,0),1>'"))
        assert await _backend_pid(store) != broken
        # The same through a statement run on the driver (the clock read, the single
        # trigger, the claim).
        broken = await _out_of_step(store, "timestamptz")
        with pytest.raises(StoreUnavailableError, match="another operation"):
            await store.now()
        assert await _backend_pid(store) != broken
        assert (await store.now()).tzinfo is not None
    finally:
        await store.close()
