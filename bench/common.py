"""Shared set-up for benchmarks: a fresh Postgres database and a Redis key prefix."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from pathlib import Path

import psycopg
import redis.asyncio as aioredis
from sqlalchemy.engine import make_url

from jobplane.backends import migrate_database
from jobplane.bus.abc import Bus
from jobplane.bus.factory import open_bus
from jobplane.dispatch import Dispatcher
from jobplane.domain.models import NewInstance
from jobplane.store.factory import open_store
from jobplane.store.sql import SqlStore

ROOT = Path(__file__).resolve().parent.parent
POSTGRES_URL = os.environ.get(
    "JOBPLANE_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
REDIS_URL = os.environ.get("JOBPLANE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def _admin(sql: str) -> None:
    dsn = make_url(POSTGRES_URL).set(drivername="postgresql").render_as_string(False)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql)


@asynccontextmanager
async def environment(*, migrate: bool = True) -> AsyncIterator[tuple[str, str, SqlStore]]:
    """(database url, key prefix, store) on a new database, removed afterwards; migrated to
    this version's schema unless ``migrate`` is false (the caller migrates it)."""
    name = f"jpbench_{uuid.uuid4().hex[:10]}"
    prefix = f"jpbench-{uuid.uuid4().hex[:10]}"
    _admin(f'CREATE DATABASE "{name}"')
    url = make_url(POSTGRES_URL).set(database=name).render_as_string(False)
    try:
        if migrate:
            await migrate_database(url)
        store = open_store(url, pool_size=5)
        try:
            yield url, prefix, store
        finally:
            await store.close()
    finally:
        _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        client = aioredis.from_url(REDIS_URL)
        keys = [k async for k in client.scan_iter(match=f"{prefix}:*", count=1000)]
        if keys:
            await client.unlink(*keys)
        await client.aclose()


@asynccontextmanager
async def kept_database(name: str) -> AsyncIterator[tuple[str, str, SqlStore]]:
    """(database url, key prefix, store) on the database ``name``, created when absent and
    migrated to head, kept afterwards (a large table is filled once for several runs)."""
    dsn = make_url(POSTGRES_URL).set(drivername="postgresql").render_as_string(False)
    with psycopg.connect(dsn, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
    if not exists:
        _admin(f'CREATE DATABASE "{name}"')
    url = make_url(POSTGRES_URL).set(database=name).render_as_string(False)
    await migrate_database(url)
    store = open_store(url, pool_size=5)
    try:
        yield url, f"jpbench-{uuid.uuid4().hex[:10]}", store
    finally:
        await store.close()


def cpu_seconds(pids: Iterable[int]) -> float:
    """User and system CPU seconds the processes ``pids`` have used so far (Linux ``/proc``;
    a process already gone counts nothing)."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def role_env(url: str, prefix: str) -> dict[str, str]:
    """The environment of a role process on the benchmark's database and key prefix."""
    return {
        **os.environ,
        "JOBPLANE_DATABASE_URL": url,
        "JOBPLANE_REDIS_URL": REDIS_URL,
        "JOBPLANE_KEY_PREFIX": prefix,
        "JOBPLANE_LOG_LEVEL": "WARNING",
    }


def spawn_scheduler(url: str, prefix: str) -> subprocess.Popen[bytes]:
    """A ``jobplane scheduler`` process (the leader once it has campaigned)."""
    command = [str(Path(sys.executable).parent / "jobplane"), "scheduler"]
    return subprocess.Popen(command, cwd=ROOT, env=role_env(url, prefix))


def spawn_worker(url: str, prefix: str, index: int, concurrency: int) -> subprocess.Popen[bytes]:
    env = role_env(url, prefix)
    return subprocess.Popen(
        [
            str(Path(sys.executable).parent / "jobplane"),
            "worker",
            "--app",
            "bench.apps:app",
            "--concurrency",
            str(concurrency),
            "--worker-id",
            f"bench-{index}",
        ],
        cwd=ROOT,
        env=env,
    )


#: Instances a call of the benchmarks' bulk triggers.
CHUNK = 1000


async def trigger_backlog(dispatcher: Dispatcher, jobs: int, key: str = "noop") -> float:
    """``jobs`` instances of ``key`` by ``trigger_many``, :data:`CHUNK` a call; the seconds
    that took."""
    started = time.perf_counter()
    for offset in range(0, jobs, CHUNK):
        n = min(CHUNK, jobs - offset)
        await dispatcher.trigger_many([NewInstance(job_key=key) for _ in range(n)])
    return time.perf_counter() - started


def bus_for(prefix: str) -> Bus:
    return open_bus(REDIS_URL, prefix)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def wait_until(predicate: Callable[[], Awaitable[bool]], timeout_s: float = 300) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("benchmark did not finish in time")
        await asyncio.sleep(0.05)


def stop_processes(procs: Iterable[subprocess.Popen[bytes]], timeout_s: float = 30) -> None:
    """SIGTERM every process still running, wait for each, and kill one that does not stop."""
    everyone = list(procs)
    for proc in everyone:
        if proc.poll() is None:
            proc.terminate()
    for proc in everyone:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
