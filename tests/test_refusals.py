"""Servers that answer but refuse for a while: Redis full (``maxmemory`` under ``noeviction``)
or demoted to a replica by a failover, and Postgres read-only (a standby, or
``default_transaction_read_only`` for maintenance). Each is an outage to wait out, like a lost
connection: no role stops, and once the server takes writes again nothing recorded is lost.
Raised as they came, these replies ended the scheduler's and the worker's processes."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import redis.asyncio as aioredis
from sqlalchemy import text
from sqlalchemy.engine import make_url

from jobplane import App
from jobplane.bus.abc import Bus
from jobplane.bus.factory import open_bus
from jobplane.domain.models import InstanceFilter
from jobplane.domain.options import JobOptions
from jobplane.domain.states import InstanceState as S
from jobplane.errors import StoreUnavailableError, UnavailableError
from jobplane.store.base import reachable
from jobplane.store.sql import SqlStore
from jobplane_scheduler.scheduler import Scheduler
from jobplane_scheduler.settings import SchedulerSettings
from tests.cli_helpers import free_port
from tests.fixtures.private_servers import private_redis
from tests.fixtures.store import admin
from tests.scheduler_helpers import FAST
from tests.worker_helpers import running_worker, settled, wait_for

beats = App("beats")


@beats.recurring("* * * * * *", max_concurrency=10)
async def beat() -> None:
    """A one-second job: its ticks go on being recorded through the outage."""


async def _ids(store: SqlStore) -> list[Any]:
    return [i.id for i in (await store.list_instances(InstanceFilter(), limit=1000)).items]


async def _answers(bus: Bus) -> bool:
    try:
        await bus.ping()
    except UnavailableError:
        return False
    return True


async def _succeeded(store: SqlStore, n: int) -> bool:
    return (await store.count_by_state("beat")).get(S.SUCCEEDED, 0) >= n


@asynccontextmanager
async def _scheduler(store: SqlStore, bus: Bus) -> AsyncIterator[asyncio.Task[None]]:
    """A running scheduler's task: the test checks it is still running during the outage."""
    values: dict[str, Any] = {"scheduler_id": f"s-{uuid.uuid4().hex[:8]}", **FAST}
    settings = SchedulerSettings(**values)
    stop = asyncio.Event()
    task = asyncio.create_task(Scheduler(store, bus, settings).run(stop))
    try:
        yield task
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)  # (raises what ended it, if anything did)


async def _redis_refuses(client: Any, fault: str) -> None:
    if fault == "full":  # a backlog filled it, under the policy docs/deploy.md asks for
        await client.config_set("maxmemory-policy", "noeviction")
        await client.config_set("maxmemory", "1")
    else:  # a failover demoted it: writes answer READONLY (no master there to sync from)
        await client.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))


async def _redis_takes_writes(client: Any) -> None:
    await client.config_set("maxmemory", "0")
    await client.execute_command("REPLICAOF", "NO", "ONE")


@pytest.mark.parametrize("fault", ["full", "replica"])
async def test_redis_refusing_writes_for_a_while_stops_no_role_and_loses_no_tick(
    pg_store: SqlStore, fault: str
) -> None:
    port = free_port()
    with private_redis(port):
        url = f"redis://127.0.0.1:{port}/0"
        client: Any = aioredis.from_url(url)
        bus = open_bus(url, f"jptest-{uuid.uuid4().hex}")
        try:
            await wait_for(lambda: _answers(bus), what="the private redis-server")
            async with running_worker(beats, pg_store, bus), _scheduler(pg_store, bus) as leader:
                await wait_for(lambda: _succeeded(pg_store, 2), what="two ticks run")
                await _redis_refuses(client, fault)
                await asyncio.sleep(3)  # ticks are recorded; their messages cannot be sent
                assert not leader.done(), leader.exception()
                await _redis_takes_writes(client)
                during = await _ids(pg_store)
                # Every tick recorded, those of the outage too, is published and run.
                done = await settled(pg_store, during, timeout_s=30)
                assert {i.state for i in done} == {S.SUCCEEDED}
        finally:
            await _redis_takes_writes(client)
            await bus.close()
            await client.aclose()


async def test_a_read_only_database_is_unavailable_not_a_refusal(pg_store: SqlStore) -> None:
    """SQLSTATE 25006 says nothing about the statement: another server (a primary) takes it.
    Translated as a refusal of the data (the store's word for poison rows), it was skipped by
    the sweeps and the fire, and ended the scheduler in its lease renewal."""
    with pytest.raises(StoreUnavailableError, match="read-only"):
        async with reachable(), pg_store.engine.begin() as conn:
            await conn.execute(text("SET TRANSACTION READ ONLY"))
            await conn.execute(text("UPDATE scheduler_leases SET term = term"))


async def test_a_scheduler_waits_out_a_read_only_database(
    pg_store: SqlStore, pg_database_url: str, postgres_url: str, redis_bus: Bus
) -> None:
    """The database turns read-only, its sessions ended (a primary demoted by a failover, or
    an operator's maintenance): the leader loses its lease and waits; writable again, it leads
    and fires again."""
    name = make_url(pg_database_url).database
    await pg_store.register_definition(
        JobOptions.parse(key="beat", kind="recurring", cron="* * * * * *"), None, "test"
    )
    async with _scheduler(pg_store, redis_bus) as leader:
        await wait_for(lambda: _recorded(pg_store, 2), what="two ticks")
        try:
            admin(
                postgres_url,
                f'ALTER DATABASE "{name}" SET default_transaction_read_only = on',
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                f" WHERE datname = '{name}' AND pid <> pg_backend_pid()",
            )
            await asyncio.sleep(3)
            assert not leader.done(), leader.exception()
        finally:
            admin(postgres_url, f'ALTER DATABASE "{name}" RESET default_transaction_read_only')
            admin(
                postgres_url,
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                f" WHERE datname = '{name}' AND pid <> pg_backend_pid()",
            )
        before = await _beats(pg_store)
        await wait_for(lambda: _recorded(pg_store, before + 2), what="ticks after the outage")


async def _beats(store: SqlStore) -> int:
    """The ticks recorded so far; a pooled connection the outage ended fails once."""
    for _ in range(3):
        try:
            return sum((await store.count_by_state("beat")).values())
        except StoreUnavailableError:
            continue
    raise AssertionError("the database stayed unreachable")


async def _recorded(store: SqlStore, n: int) -> bool:
    return await _beats(store) >= n
