"""A leader frozen (SIGSTOP) inside its fenced transaction does not block the takeover: the
server ends its idle transaction (the session limits every role sets), the fence's lock goes
with it, and a new leader fires within the lease TTL + 1 s. The deposed leader, resumed,
commits nothing."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime

import psycopg
import pytest

from jobplane.domain.models import InstanceFilter
from jobplane.store.sql import SqlStore
from jobplane_scheduler.settings import SchedulerSettings
from tests.cli_helpers import spawn_cli, stop_all
from tests.store_helpers import define
from tests.worker_helpers import wait_for

pytestmark = pytest.mark.timeout(120)

TTL_S = 3.0


@pytest.fixture
def schedulers(
    pg_database_url: str, redis_url: str, redis_prefix: str
) -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    env = {
        "JOBPLANE_DATABASE_URL": pg_database_url,
        "JOBPLANE_REDIS_URL": redis_url,
        "JOBPLANE_KEY_PREFIX": redis_prefix,
        "JOBPLANE_LEASE_TTL_S": str(TTL_S),
        "JOBPLANE_SWEEP_INTERVAL_S": "0.2",
    }
    procs.append(spawn_cli("scheduler", **env))
    yield procs
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
    stop_all(procs)


def _holder_pid(holder: str) -> int:
    return int(holder.rsplit(":", 1)[1])


def _dsn(url: str) -> str:
    return url.replace("postgresql+asyncpg://", "postgresql://")


def test_session_limits_are_sized_from_the_lease() -> None:
    limits = SchedulerSettings(lease_ttl_s=TTL_S).session_limits()
    assert limits.idle_in_transaction_timeout_s == TTL_S / 2
    assert limits.lock_timeout_s == TTL_S / 2
    assert SchedulerSettings(lease_ttl_s=30).session_limits().idle_in_transaction_timeout_s == 2


async def test_a_leader_frozen_inside_its_fenced_transaction_is_replaced_in_time(
    pg_store: SqlStore,
    pg_database_url: str,
    redis_url: str,
    redis_prefix: str,
    schedulers: list[subprocess.Popen[str]],
) -> None:
    await define(pg_store, "tick", cron="* * * * * *")
    first = schedulers[0]

    async def first_leads() -> bool:
        lease = await pg_store.get_leader(0)
        return lease is not None and _holder_pid(lease.holder) == first.pid

    await wait_for(first_leads, timeout_s=30, what="the first scheduler to lead")
    await wait_for(lambda: _some(pg_store), timeout_s=10, what="the first leader's first ticks")
    env = {
        "JOBPLANE_DATABASE_URL": pg_database_url,
        "JOBPLANE_REDIS_URL": redis_url,
        "JOBPLANE_KEY_PREFIX": redis_prefix,
        "JOBPLANE_LEASE_TTL_S": str(TTL_S),
        "JOBPLANE_SWEEP_INTERVAL_S": "0.2",
    }
    second = spawn_cli("scheduler", **env)
    schedulers.append(second)

    async def second_stands_by() -> bool:
        replicas = await pg_store.list_schedulers(0)
        return any(_holder_pid(r.holder) == second.pid for r in replicas)

    await wait_for(second_stands_by, timeout_s=30, what="the second scheduler to campaign")

    # Catch the leader inside its fenced transaction: hold the instance table against writes
    # and row locks (plain reads still pass) so that a sweep's locking read, after the fence
    # took its lock on the lease row, waits; freeze the process there; then let it through. Its
    # session is now idle in a transaction that holds the fence's lock, with nobody to commit
    # it - a leader frozen mid-write. (Blocking reads too would also stop the leader's unfenced
    # reads, each until its lock timeout, and its duties restart with one of them, so it might
    # never reach a fenced transaction while the table is held.)
    with psycopg.connect(_dsn(pg_database_url), autocommit=False) as blocker:
        blocker.execute("LOCK TABLE job_instances IN EXCLUSIVE MODE")
        _wait_for_backend_waiting_on_a_lock(pg_database_url)
        os.kill(first.pid, signal.SIGSTOP)
        blocker.commit()
    frozen_at = await pg_store.now()
    state = _wait_for_idle_in_transaction(pg_database_url)
    assert state == ("idle in transaction",), (state, _activity(pg_database_url))

    async def second_fired() -> bool:
        lease = await pg_store.get_leader(0)
        if lease is None or _holder_pid(lease.holder) != second.pid:
            return False
        return bool(await _created_after(pg_store, frozen_at))

    await wait_for(second_fired, timeout_s=3 * TTL_S, what="the second scheduler to fire")
    fired_at = min(await _created_after(pg_store, frozen_at))
    failover_s = (fired_at - frozen_at).total_seconds()
    print(f"failover with the leader frozen inside a fenced transaction: {failover_s:.3f} s")  # noqa: T201
    assert failover_s <= TTL_S + 1.0

    # The frozen leader resumes: its transaction is gone, it commits nothing and stands down.
    os.kill(first.pid, signal.SIGCONT)
    await asyncio.sleep(2.0)
    assert first.poll() is None  # still running, as a follower
    lease = await pg_store.get_leader(0)
    assert lease is not None and _holder_pid(lease.holder) == second.pid
    ticks = [
        i.scheduled_at
        for i in (await pg_store.list_instances(InstanceFilter(job_key="tick"), limit=5000)).items
    ]
    assert len(ticks) == len(set(ticks))


async def _some(store: SqlStore) -> bool:
    return sum((await store.count_by_state("tick")).values()) >= 2


async def _created_after(store: SqlStore, at: datetime) -> list[datetime]:
    page = await store.list_instances(InstanceFilter(job_key="tick"), limit=5000)
    return [i.created_at for i in page.items if i.created_at > at]


def _wait_for_idle_in_transaction(url: str) -> tuple[str, ...] | None:
    """The state of a backend inside a fenced transaction (holding its lock on the lease table)
    once its write has gone through, polled: a loaded machine takes longer than any fixed
    pause. Any such backend will do: the frozen leader may have had two fenced transactions
    waiting on the instance table (a tick's insert and a sweep's update), and when both
    connections count into the same counter shard (backend pid modulo 16) the second waits on
    the first, which is frozen, until the server ends the first's idle transaction.

    The server ends an idle transaction ``TTL_S / 2`` after it went idle, so the wait lasts
    that long after the last moment such a backend was still running its statement (on a
    loaded machine a statement let through by the test can run longer than that), up to 15 s.
    """
    hard_deadline = time.monotonic() + 15
    deadline = time.monotonic() + TTL_S / 2  # the server ends the idle transaction then
    with psycopg.connect(_dsn(url), autocommit=True) as probe:
        while True:
            states = [
                tuple(row)
                for row in probe.execute(
                    "SELECT a.state FROM pg_stat_activity a "
                    "WHERE a.datname = current_database() AND EXISTS (SELECT 1 FROM pg_locks l "
                    "WHERE l.pid = a.pid AND l.granted "
                    "AND l.relation = 'scheduler_leases'::regclass)"
                ).fetchall()
            ]
            if ("idle in transaction",) in states:
                return ("idle in transaction",)
            if ("active",) in states:
                deadline = time.monotonic() + TTL_S / 2
            if time.monotonic() > min(deadline, hard_deadline):
                return states[0] if states else None
            time.sleep(0.01)


def _activity(url: str) -> list[tuple[object, ...]]:
    """What every session of the database is doing, with the locks it holds or waits for and
    who blocks it (shown when the test cannot catch the leader where it means to)."""
    with psycopg.connect(_dsn(url), autocommit=True) as probe:
        return [
            tuple(row)
            for row in probe.execute(
                "SELECT a.pid, a.state, a.wait_event_type, a.wait_event, "
                "a.xact_start < a.query_start, left(a.query, 100), "
                "(SELECT string_agg(l.locktype || ' ' || coalesce(l.relation::regclass::text, '')"
                " || ' ' || l.mode || ' ' || l.granted, '; ') FROM pg_locks l "
                "WHERE l.pid = a.pid), pg_blocking_pids(a.pid) "
                "FROM pg_stat_activity a WHERE a.datname = current_database()"
            ).fetchall()
        ]


def _wait_for_backend_waiting_on_a_lock(url: str) -> int:
    deadline = time.monotonic() + 10
    with psycopg.connect(_dsn(url), autocommit=True) as probe:
        while time.monotonic() < deadline:
            # A backend waiting on a lock while it holds one on the lease table: the leader,
            # inside a fenced transaction (the fence locked its lease row first), one of
            # several statements (a sweep's: begun before the statement that waits). A tick's
            # fire is one statement in autocommit: unblocked, it commits by itself, and its
            # session is never left idle in a transaction by a frozen leader.
            row = probe.execute(
                "SELECT a.pid FROM pg_stat_activity a WHERE a.datname = current_database() "
                "AND a.wait_event_type = 'Lock' AND a.xact_start < a.query_start "
                "AND EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = a.pid AND l.granted "
                "AND l.relation = 'scheduler_leases'::regclass)"
            ).fetchone()
            if row is not None:
                return int(row[0])
            time.sleep(0.01)
    raise AssertionError("the leader never waited on the instance table")
