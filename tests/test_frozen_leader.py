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
from dataclasses import replace
from datetime import datetime
from typing import Any

import psycopg
import pytest

from jobplane.domain.models import InstanceFilter
from jobplane.errors import StoreConflictError
from jobplane.store.factory import open_store
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


async def _hold_lease_row_active(url: str, holder: str) -> tuple[psycopg.AsyncConnection, Any]:
    """A session of ``holder`` inside a fenced transaction (the lease row share-locked, as a
    leader's fence does), left *active*: a long statement here, as a frozen client after its
    driver's Parse leaves it too. The server's idle-in-transaction limit never ends it."""
    conn = await psycopg.AsyncConnection.connect(_dsn(url), application_name=holder)
    await conn.execute("SELECT term FROM scheduler_leases WHERE shard = 0 FOR SHARE")
    running = asyncio.ensure_future(conn.execute("SELECT pg_sleep(60)"))
    await asyncio.sleep(0.2)  # the statement is under way
    return conn, running


async def test_a_takeover_ends_the_expired_leader_s_session_left_active_on_the_lease(
    pg_store: SqlStore, pg_database_url: str
) -> None:
    old = await pg_store.acquire_leadership(0, "frozen-replica", 0.5)
    assert old is not None
    conn, running = await _hold_lease_row_active(pg_database_url, "frozen-replica")
    try:
        await asyncio.sleep(0.5)  # the lease expires (the database's clock)
        # Without the end of that session the takeover waits on the row lock for as long as
        # the session lives (here: no lock timeout on this store).
        new = await asyncio.wait_for(pg_store.acquire_leadership(0, "standby", 3.0), 10)
        assert new is not None and (new.holder, new.term) == ("standby", old.term + 1)
        with pytest.raises(psycopg.OperationalError):
            await running  # the frozen leader's transaction is gone, written nothing
    finally:
        await conn.close()


async def test_a_live_leader_s_sessions_are_never_ended(pg_database_url: str) -> None:
    # The same session, but the lease is live: a standby's try waits out its lock timeout and
    # takes nothing, and the leader's session goes on. (The standby's own idle limit is raised:
    # at half a second, a loaded machine's pause between two of its statements ended its
    # transaction, an outage where the test waits for the lock timeout.)
    limits = SchedulerSettings(lease_ttl_s=1.0).session_limits()
    store = open_store(
        pg_database_url,
        limits=replace(limits, application_name="b", idle_in_transaction_timeout_s=5.0),
    )
    try:
        assert await store.acquire_leadership(0, "leader", 60.0) is not None
        conn, running = await _hold_lease_row_active(pg_database_url, "leader")
        try:
            with pytest.raises(StoreConflictError):
                await store.acquire_leadership(0, "standby", 3.0)
            assert not running.done()
            running.cancel()
        finally:
            await conn.close()
    finally:
        await store.close()


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
    leading = await pg_store.get_leader(0)
    assert leading is not None
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
    # and row locks (plain reads still pass) so that a sweep's locking statement, after the
    # fence took its lock on the lease row, waits; freeze the process there; then let it
    # through. Its session is now left inside a transaction that holds the fence's lock, with
    # nobody to commit it - a leader frozen mid-write: idle in the transaction (its statement
    # ran; the server ends the transaction after the idle limit), or still active, waiting for
    # the client (the wait was in the statement's parse, which takes the locks: asyncpg
    # prepares with Parse, Describe and Flush, and the server then waits for the Bind with the
    # statement active, which no idle limit ends; the takeover ends that session). (Blocking
    # reads too would also stop the leader's unfenced reads, each until its lock timeout, and
    # its duties restart with one of them, so it might never reach a fenced transaction while
    # the table is held.)
    with psycopg.connect(_dsn(pg_database_url), autocommit=False) as blocker:
        blocker.execute("LOCK TABLE job_instances IN EXCLUSIVE MODE")
        _wait_for_backend_waiting_on_a_lock(pg_database_url)
        os.kill(first.pid, signal.SIGSTOP)
        blocker.commit()
    frozen_at = await pg_store.now()
    state = _wait_for_frozen_fenced_session(pg_database_url, leading.holder)
    if state not in FROZEN_STATES:
        # Every row, one a line (an assertion's message would be cut short).
        rows = "\n".join(repr(row) for row in _activity(pg_database_url))
        pytest.fail(f"no fenced session of the frozen leader ({state}); sessions:\n{rows}")

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


#: A fenced session of a frozen leader, once its statement got through: idle in its
#: transaction, or active and waiting for the client (a prepared statement's Bind).
FROZEN_STATES = (("idle in transaction", None), ("active", "ClientRead"))


def _wait_for_frozen_fenced_session(url: str, holder: str) -> tuple[str, str | None] | None:
    """The (state, wait event) of a session of ``holder`` (its ``application_name``) inside a
    fenced transaction (holding its lock on the lease table) once its statement has gone
    through, polled: a loaded machine takes longer than any fixed pause. Any such session will
    do: the frozen leader may have had two fenced transactions waiting on the instance table
    (a tick's insert and a sweep's update), and when both connections count into the same
    counter shard (backend pid modulo 16) the second waits on the first, which is frozen, until
    the first is ended.

    A session still running its statement (or waiting on a lock) may yet reach one of
    :data:`FROZEN_STATES`, so the wait lasts ``TTL_S / 2`` after the last moment one was seen
    running (on a loaded machine a statement let through by the test can run longer than
    that), up to 15 s."""
    hard_deadline = time.monotonic() + 15
    deadline = time.monotonic() + TTL_S / 2
    with psycopg.connect(_dsn(url), autocommit=True) as probe:
        while True:
            states = [
                (str(state), event)
                for state, event in probe.execute(
                    "SELECT a.state, a.wait_event FROM pg_stat_activity a "
                    "WHERE a.datname = current_database() AND a.application_name = %s "
                    "AND EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = a.pid AND l.granted "
                    "AND l.relation = 'scheduler_leases'::regclass)",
                    (holder[:63],),
                ).fetchall()
            ]
            for frozen in FROZEN_STATES:
                if any(s == frozen[0] and (frozen[1] is None or e == frozen[1]) for s, e in states):
                    return frozen
            if any(s == "active" for s, _ in states):
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
