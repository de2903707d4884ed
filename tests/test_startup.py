"""Every role waits for Postgres and Redis at start, for a bounded time, as real processes.

The servers started late here are the tests' own, on free ports; the shared ones are never
stopped or touched.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import time
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy import text

from jobplane.errors import StoreUnavailableError
from jobplane.settings import SessionLimits
from jobplane.store import schema
from jobplane.store.factory import open_store
from tests.cli_helpers import (
    free_port,
    output_of,
    run_cli,
    spawn_cli,
    stop_all,
    wait_for_output,
    wait_http_ok,
)
from tests.fixtures.private_servers import private_postgres, private_redis

CLOSED_DATABASE = "postgresql://nobody@127.0.0.1:1/nowhere"

ROLES = {
    "api": ["api", "--host", "127.0.0.1", "--port", "0"],
    "scheduler": ["scheduler"],
    "worker": ["worker", "--app", "tests.apps.basic:app"],
    "migrate": ["migrate"],
}


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    stop_all(started)


@pytest.mark.parametrize("role", ROLES)
def test_a_role_retries_then_exits_2_with_one_line(role: str) -> None:
    began = time.monotonic()
    result = run_cli(
        *ROLES[role],
        JOBPLANE_DATABASE_URL=CLOSED_DATABASE,
        JOBPLANE_REDIS_URL="redis://127.0.0.1:1/0",
        JOBPLANE_STARTUP_TIMEOUT_S="2",
    )
    elapsed = time.monotonic() - began
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    [error] = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert "127.0.0.1:1" in error
    waits = [ln for ln in result.stderr.splitlines() if "waiting for the database" in ln]
    assert len(waits) >= 2, result.stderr  # each failed try is logged
    assert "try 1 failed" in waits[0] and "try 2 failed" in waits[1]
    assert 1.4 < elapsed < 30, elapsed  # it waited, and not much past its timeout


async def test_sigterm_while_waiting_ends_the_wait_at_once(
    procs: list[subprocess.Popen[str]],
) -> None:
    proc = spawn_cli(
        "scheduler", JOBPLANE_DATABASE_URL=CLOSED_DATABASE, JOBPLANE_STARTUP_TIMEOUT_S="300"
    )
    procs.append(proc)
    await wait_for_output(proc, "waiting for the database")
    began = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 2
    assert time.monotonic() - began < 5
    assert "Traceback" not in output_of(proc)


async def test_roles_wait_for_redis_started_late(
    procs: list[subprocess.Popen[str]], pg_database_url: str
) -> None:
    port, health_port, api_port = free_port(), free_port(), free_port()
    env = {
        "JOBPLANE_DATABASE_URL": pg_database_url,
        "JOBPLANE_REDIS_URL": f"redis://127.0.0.1:{port}/0",
        "JOBPLANE_STARTUP_TIMEOUT_S": "120",
    }
    worker = spawn_cli(
        "worker", "--app", "tests.apps.basic:app", "--health-port", str(health_port), **env
    )
    scheduler = spawn_cli("scheduler", **env)
    api = spawn_cli("api", "--host", "127.0.0.1", "--port", str(api_port), **env)
    procs.extend([worker, scheduler, api])
    for proc in procs:
        await wait_for_output(proc, "waiting for redis")
    with private_redis(port):
        wait_http_ok(f"http://127.0.0.1:{api_port}/readyz", timeout_s=60)
        wait_http_ok(f"http://127.0.0.1:{health_port}/readyz", timeout_s=60)
        store = open_store(pg_database_url)
        try:
            leader = None
            deadline = time.monotonic() + 60
            while leader is None and time.monotonic() < deadline:
                leader = await store.get_leader(0)
                await asyncio.sleep(0.2)
            assert leader is not None, output_of(scheduler)
        finally:
            await store.close()
        assert [p.poll() for p in procs] == [None, None, None]
        stop_all(procs, sig=signal.SIGTERM)
        assert [p.returncode for p in procs] == [0, 0, 0]
        procs.clear()


async def test_migrate_and_api_wait_for_postgres_started_late(
    procs: list[subprocess.Popen[str]], redis_url: str, redis_prefix: str
) -> None:
    """The api started beside the migration (as in Kubernetes) waits for the server, then for
    the schema, then serves."""
    with private_postgres() as server:
        api_port = free_port()
        env = {
            "JOBPLANE_DATABASE_URL": server.url,
            "JOBPLANE_REDIS_URL": redis_url,
            "JOBPLANE_KEY_PREFIX": redis_prefix,
            "JOBPLANE_STARTUP_TIMEOUT_S": "120",
        }
        api = spawn_cli("api", "--host", "127.0.0.1", "--port", str(api_port), **env)
        migrate = spawn_cli("migrate", **env)
        procs.extend([api, migrate])
        await wait_for_output(api, "waiting for the database")
        await wait_for_output(migrate, "waiting for the database")
        server.start()
        assert migrate.wait(timeout=60) == 0, output_of(migrate)
        assert "database schema at revision" in output_of(migrate)
        wait_http_ok(f"http://127.0.0.1:{api_port}/readyz", timeout_s=60)
        wait_http_ok(f"http://127.0.0.1:{api_port}/healthz", timeout_s=5)
        stop_all(procs, sig=signal.SIGTERM)
        assert api.returncode == 0
        procs.clear()


def test_a_schema_newer_than_the_code_is_refused_at_once(pg_database_url: str) -> None:
    """Only a schema behind the code is waited for (a migration may be running); one this
    version does not know was migrated by a newer release: waiting would not help."""
    with psycopg.connect(pg_database_url, autocommit=True) as conn:
        conn.execute("UPDATE alembic_version SET version_num = 'f00dfeedbeef'")
    began = time.monotonic()
    result = run_cli(
        "scheduler", JOBPLANE_DATABASE_URL=pg_database_url, JOBPLANE_STARTUP_TIMEOUT_S="60"
    )
    assert result.returncode == 2, result.stderr
    # Well inside its 60 s startup timeout (the process's own start took over 20 s on a loaded
    # machine); that it never waited shows in its log.
    assert time.monotonic() - began < 50
    assert "waiting for" not in result.stderr
    [error] = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert "f00dfeedbeef" in error and "migrated by a newer Jobplane" in error


async def test_a_server_that_never_answers_is_unavailable_within_the_connect_timeout() -> None:
    """A host that accepts the connection and then says nothing (a half-dead server, a
    black-holing proxy) is an outage after ``connect_timeout_s``, not after asyncpg's 60 s."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel accepts; nobody ever answers
    port = silent.getsockname()[1]
    limits = SessionLimits(
        lock_timeout_s=1,
        idle_in_transaction_timeout_s=1,
        statement_timeout_s=5,
        keepalive_s=5,
        connect_timeout_s=0.5,
    )
    store = open_store(f"postgresql://postgres@127.0.0.1:{port}/test", limits=limits)
    started = time.monotonic()
    try:
        with pytest.raises(StoreUnavailableError):
            await store.ping()
    finally:
        await store.close()
        silent.close()
    assert time.monotonic() - started < 5


async def test_a_connection_lost_while_the_schema_is_checked_is_an_outage(
    pg_database_url: str,
) -> None:
    """A role checks the schema revision as it starts. On a loaded machine its session can
    pass its idle-in-transaction limit between the check's two reads, and Postgres closes
    it: that is an outage the start waits out (``StoreUnavailableError``), not a crash with
    the driver's error."""
    store = open_store(pg_database_url, pool_size=1)
    try:
        async with store.engine.connect() as conn:  # the pool's one connection
            pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
        with psycopg.connect(pg_database_url) as pg:
            pg.execute("SELECT pg_terminate_backend(%s)", (pid,))
        with pytest.raises(StoreUnavailableError):
            await store.schema_revision()
        assert await store.schema_revision() == schema.head_revision()  # reconnected
    finally:
        await store.close()
