"""A cron tick written ahead of its time and committed at it (Postgres: ``fire_ahead``).

The leader writes a tick's instances a moment before the tick in a transaction it leaves open,
and commits it at the tick. These tests hold such a write open on a real Postgres and check
what the open transaction promises: nobody sees the instances before the commit; an edit of
one of its jobs, and a takeover of the lease, wait for it and so come after the tick; a write
given up, refused or left open past the session's idle limit leaves nothing; the scheduler
commits its ticks at their time, never before, and counts their lag to the commit."""

from __future__ import annotations

import asyncio
import gc
import time
from datetime import datetime, timedelta

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from jobplane.bus.abc import Bus
from jobplane.domain.models import Instance, InstanceFilter, LeaderLease, NewInstance
from jobplane.domain.states import InstanceState as S
from jobplane.errors import (
    DefinitionsChangedError,
    StoreConflictError,
    StoreRefusedError,
    StoreUnavailableError,
)
from jobplane.settings import SessionLimits
from jobplane.store.abc import HeldFire
from jobplane.store.ahead import PostgresHeldFire
from jobplane.store.factory import open_store
from jobplane.store.sql import SqlStore
from jobplane_scheduler.ahead import COMMIT_EARLY_S, COMMIT_WITHIN_S
from jobplane_scheduler.cron_timers import occurrence
from jobplane_scheduler.metrics import SchedulerMetrics
from tests.scheduler_helpers import running_scheduler
from tests.store_helpers import define, enqueue
from tests.worker_helpers import wait_for

KEYS = ["a", "b", "c"]


async def _jobs(store: SqlStore) -> dict[str, int]:
    """Three recurring jobs; their keys → stored versions."""
    for key in KEYS:
        await define(store, key, cron="* * * * * *")
    return {key: (await store.get_definition(key)).version for key in KEYS}


async def _lease(store: SqlStore, holder: str = "ahead-test", ttl_s: float = 30) -> LeaderLease:
    lease = await store.acquire_leadership(0, holder, ttl_s)
    assert lease is not None
    return lease


async def _tick(store: SqlStore, ahead_s: float = 1.0) -> datetime:
    """A whole second at least ``ahead_s`` after the database's now."""
    now = await store.now()
    return now.replace(microsecond=0) + timedelta(seconds=ahead_s + 1)


def _checked_out(store: SqlStore) -> int:
    """Connections of the store's pool in use."""
    return int(store.engine.pool.checkedout())  # type: ignore[attr-defined]


def _records(at: datetime) -> list[NewInstance]:
    return [occurrence(key, at) for key in KEYS]


async def _count(store: SqlStore, at: datetime) -> int:
    """Committed cron instances of the tick at ``at``, as another session sees them."""
    async with store.engine.connect() as conn:
        query = "SELECT count(*) FROM job_instances WHERE source = 'cron' AND scheduled_at = :at"
        return int((await conn.execute(text(query), {"at": at})).scalar_one())


async def _idle_in_transaction(store: SqlStore) -> int:
    """Sessions of the store's database left inside a transaction."""
    async with store.engine.connect() as conn:
        query = (
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND state LIKE 'idle in transaction%'"
        )
        return int((await conn.execute(text(query))).scalar_one())


async def _hold(
    store: SqlStore, lease: LeaderLease, at: datetime, planned: dict[str, int]
) -> HeldFire:
    held = await store.fire_ahead(lease, _records(at), published=True, planned=planned)
    assert held is not None
    return held


async def test_a_tick_written_ahead_is_seen_by_nobody_until_its_commit(
    pg_store: SqlStore,
) -> None:
    planned = await _jobs(pg_store)
    at = await _tick(pg_store, ahead_s=2.0)  # (written well before it, on a busy machine too)
    held = await _hold(pg_store, await _lease(pg_store), at, planned)
    assert {i.job_key for i in held.instances} == set(KEYS)
    assert await _count(pg_store, at) == 0
    committed = await held.commit(60.0)  # (asked before the tick: it waits for the tick)
    assert await pg_store.now() >= at
    assert [i.id for i in committed] == [i.id for i in held.instances]
    assert await _count(pg_store, at) == 3
    for instance in committed:
        stored = await pg_store.get_instance(instance.id)
        # Written before its tick, it came into being at the commit: its creation time and
        # record say the tick (never a time before it).
        assert stored.state is S.ENQUEUED
        assert stored.created_at == at and stored.published_at == at
        [created] = await pg_store.transitions(instance.id)
        assert created.to_state is S.ENQUEUED and created.at == at
    assert _checked_out(pg_store) == 0
    # Their recorded lag is none: the leader counts the commit's lag, measured by itself.
    metrics = SchedulerMetrics(lambda: None)
    metrics.fired(committed, {})
    assert metrics.registry.get_sample_value("jobplane_scheduler_fire_lag_seconds_sum") == 0
    metrics.fired(committed, {}, 0.004)
    lags = metrics.registry.get_sample_value("jobplane_scheduler_fire_lag_seconds_sum")
    assert lags == pytest.approx(3 * 0.004)


async def test_a_held_tick_committed_too_late_is_refused_by_the_database(
    pg_store: SqlStore,
) -> None:
    """Its records would say the tick: past ``within_s`` on the database's clock (a leader
    that stalled, or whose reading of the clock was held up and so believed itself on time),
    the commit is refused, nothing is recorded, and the fire at its time records when it was."""
    planned = await _jobs(pg_store)
    at = await _tick(pg_store, ahead_s=-3.0)  # (1 to 2 s ago)
    held = await _hold(pg_store, await _lease(pg_store), at, planned)
    with pytest.raises(StoreRefusedError, match="reached late"):
        await held.commit(0.05)
    assert _checked_out(pg_store) == 0 and await _idle_in_transaction(pg_store) == 0
    assert await _count(pg_store, at) == 0


async def test_an_abandoned_tick_leaves_nothing_and_gives_its_connection_back(
    pg_store: SqlStore,
) -> None:
    planned = await _jobs(pg_store)
    at = await _tick(pg_store)
    held = await _hold(pg_store, await _lease(pg_store), at, planned)
    assert _checked_out(pg_store) == 1
    await held.abandon()
    await held.abandon()  # (a no-op the second time)
    assert _checked_out(pg_store) == 0
    assert await _count(pg_store, at) == 0
    assert await _idle_in_transaction(pg_store) == 0  # (rolled back, not pooled open)


async def test_a_tick_recorded_before_is_not_written_ahead(pg_store: SqlStore) -> None:
    """Two leaders overlapping: one of the tick's instances is recorded already. The write
    ahead gives up (the fire at the tick reads what is recorded) and holds nothing."""
    planned = await _jobs(pg_store)
    at = await _tick(pg_store)
    lease = await _lease(pg_store)
    [recorded] = await pg_store.fire(lease, [occurrence("b", at)], planned=planned)
    with pytest.raises(StoreConflictError):
        await pg_store.fire_ahead(lease, _records(at), planned=planned)
    assert _checked_out(pg_store) == 0 and await _idle_in_transaction(pg_store) == 0
    assert await _count(pg_store, at) == 1
    fired = await pg_store.fire(lease, _records(at), planned=planned)
    assert recorded.id in {i.id for i in fired} and await _count(pg_store, at) == 3


async def test_an_edit_committed_before_the_write_refuses_it(pg_store: SqlStore) -> None:
    planned = await _jobs(pg_store)
    await pg_store.set_paused("b", True, "test")
    at = await _tick(pg_store)
    with pytest.raises(DefinitionsChangedError) as refused:
        await pg_store.fire_ahead(await _lease(pg_store), _records(at), planned=planned)
    assert refused.value.keys == {"b"}
    assert _checked_out(pg_store) == 0
    assert await _count(pg_store, at) == 0


async def test_an_edit_of_a_held_job_waits_for_the_commit(pg_store: SqlStore) -> None:
    """A pause made while the tick is held cannot slip in between the write and the commit
    (the write's snapshot would not see it): it waits for the commit, and so comes after the
    tick, as it would after a tick fired at its time."""
    planned = await _jobs(pg_store)
    at = await _tick(pg_store)
    held = await _hold(pg_store, await _lease(pg_store), at, planned)
    pausing = asyncio.ensure_future(pg_store.set_paused("b", True, "test"))
    done, _ = await asyncio.wait([pausing], timeout=0.5)
    assert not done, "the pause did not wait for the held tick"
    await held.commit(60.0)
    paused = await asyncio.wait_for(pausing, timeout=10)
    assert paused.paused and paused.version == planned["b"] + 1
    assert await _count(pg_store, at) == 3


async def test_a_claim_on_the_held_session_s_count_shard_does_not_wait_for_the_tick(
    pg_store: SqlStore, pg_database_url: str
) -> None:
    """A held tick keeps the instance-count rows it wrote locked until its commit. It writes
    them on a shard of its own, so a claim of one of its jobs' earlier instances, made on a
    session whose own shard (its pid modulo 16) is the held session's, does not wait for the
    tick (before migration 0024 it did, holding the job's slot meanwhile)."""
    planned = await _jobs(pg_store)
    [earlier] = await enqueue(pg_store, "a")
    held = await _hold(pg_store, await _lease(pg_store), await _tick(pg_store), planned)
    dsn = make_url(pg_database_url).set(drivername="postgresql").render_as_string(False)
    session: asyncpg.Connection | None = None
    try:
        async with pg_store.engine.connect() as conn:
            query = (
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                " AND state LIKE 'idle in transaction%' AND backend_xid IS NOT NULL"
            )
            held_pid = int((await conn.execute(text(query))).scalar_one())
        for _ in range(400):  # (each new session a new pid: one in 16 or so shares its shard)
            session = await asyncpg.connect(dsn)
            if session.get_server_pid() % 16 == held_pid % 16:
                break
            await session.close()
            session = None
        assert session is not None, "no session of the held session's shard in 400"
        await session.execute("SET lock_timeout = '1s'")
        # What a claim does to the counts: the instance leaves Enqueued for Processing.
        moved = await session.execute(
            "UPDATE job_instances SET state = 'processing' WHERE id = $1", earlier.id
        )
        assert moved == "UPDATE 1"
    finally:
        if session is not None:
            await session.close()
        await held.abandon()
    counts = await pg_store.count_by_state("a")
    assert counts == {S.PROCESSING: 1}, counts


async def test_a_takeover_waits_for_the_held_tick_which_fires_once(pg_store: SqlStore) -> None:
    """The lease runs out while its leader holds a tick: a standby's takeover waits for the
    commit, then finds the tick recorded; its own fire of the tick records nothing more."""
    planned = await _jobs(pg_store)
    at = await _tick(pg_store)
    lease = await _lease(pg_store, "old", ttl_s=0.5)
    held = await _hold(pg_store, lease, at, planned)
    await asyncio.sleep(0.7)  # (expired now)
    taking = asyncio.ensure_future(pg_store.acquire_leadership(0, "new", 30))
    done, _ = await asyncio.wait([taking], timeout=0.5)
    assert not done, "the takeover did not wait for the held tick"
    await held.commit(60.0)
    new = await asyncio.wait_for(taking, timeout=10)
    assert new is not None and new.term == lease.term + 1
    again = await pg_store.fire(new, _records(at), planned=planned)
    assert {i.id for i in again} == {i.id for i in held.instances}
    assert await _count(pg_store, at) == 3


async def test_a_takeover_ends_a_frozen_leader_s_held_tick_which_the_new_leader_fires(
    pg_database_url: str, pg_store: SqlStore
) -> None:
    """As a standby takes over from a leader that froze holding a tick, it ends the expired
    holder's sessions on the lease row (the held one among them): the tick is rolled back
    rather than waited for, and the new leader fires it, once."""
    limits = SessionLimits(
        lock_timeout_s=2, idle_in_transaction_timeout_s=30, statement_timeout_s=30,
        keepalive_s=5, application_name="old",
    )  # fmt: skip
    old_store = open_store(pg_database_url, limits=limits)
    try:
        planned = await _jobs(pg_store)
        at = await _tick(pg_store)
        lease = await _lease(old_store, "old", ttl_s=0.5)
        held = await _hold(old_store, lease, at, planned)
        await asyncio.sleep(0.7)  # (expired now)
        new = await asyncio.wait_for(pg_store.acquire_leadership(0, "new", 30), timeout=1.5)
        assert new is not None and new.term == lease.term + 1
        with pytest.raises(StoreUnavailableError):
            await held.commit(60.0)
        await held.abandon()  # (its session is gone: nothing raised)
        assert _checked_out(old_store) == 0
        assert await _count(pg_store, at) == 0
        fired = await pg_store.fire(new, _records(at), planned=planned)
        assert len(fired) == 3 and await _count(pg_store, at) == 3
    finally:
        await old_store.close()


async def test_a_held_tick_whose_session_died_is_given_up_without_an_error(
    pg_store: SqlStore,
) -> None:
    """A restart, or the idle limit, ended the session under a held tick: giving it up
    (a re-plan, a stop) raises nothing, and the connection goes back to the pool."""
    planned = await _jobs(pg_store)
    at = await _tick(pg_store)
    held = await _hold(pg_store, await _lease(pg_store), at, planned)
    async with pg_store.engine.connect() as conn:
        query = (
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND state = 'idle in transaction'"
        )
        assert (await conn.execute(text(query))).scalar_one()
    await asyncio.sleep(0.1)
    await held.abandon()
    assert _checked_out(pg_store) == 0
    assert await _count(pg_store, at) == 0


async def test_a_write_ahead_waits_for_no_edit_under_way(pg_store: SqlStore) -> None:
    """An edit of one of the tick's jobs is under way (its row locked): the write ahead gives
    up within its short lock limit rather than holding the leader's planning up, and the
    tick is fired at its time."""
    planned = await _jobs(pg_store)
    at = await _tick(pg_store)
    lease = await _lease(pg_store)
    async with pg_store.engine.connect() as editing:
        await editing.execute(text("UPDATE job_definitions SET updated_by = 'x' WHERE key = 'b'"))
        started = asyncio.get_running_loop().time()
        with pytest.raises(StoreConflictError):
            writing = pg_store.fire_ahead(lease, _records(at), planned=planned)
            await asyncio.wait_for(writing, timeout=5)
        assert asyncio.get_running_loop().time() - started < 1.0
        await editing.rollback()
    assert _checked_out(pg_store) == 0
    assert await _count(pg_store, at) == 0


async def test_a_worker_registering_unchanged_jobs_does_not_wait_for_a_held_tick(
    pg_store: SqlStore,
) -> None:
    """Every worker's start registers its jobs; one that changes nothing writes nothing, so
    it does not wait for the tick's commit."""
    planned = await _jobs(pg_store)
    at = await _tick(pg_store)
    held = await _hold(pg_store, await _lease(pg_store), at, planned)
    try:
        definition = await pg_store.get_definition("b")
        registering = pg_store.register_definition(definition.options, None, "worker")
        again, created = await asyncio.wait_for(registering, timeout=1.0)
        assert not created and again.version == planned["b"]
    finally:
        await held.abandon()


async def test_a_tick_held_past_the_idle_limit_is_rolled_back_by_the_server(
    pg_database_url: str,
) -> None:
    """A leader that froze with a tick held open (SIGSTOP, a stall) does not keep its locks:
    the server ends the session at its idle-in-transaction limit, and the tick is not
    recorded (whoever leads then fires it)."""
    limits = SessionLimits(
        lock_timeout_s=2, idle_in_transaction_timeout_s=0.3, statement_timeout_s=30, keepalive_s=5
    )
    store = open_store(pg_database_url, limits=limits)
    try:
        planned = await _jobs(store)
        at = await _tick(store)
        held = await _hold(store, await _lease(store), at, planned)
        await asyncio.sleep(1.0)
        with pytest.raises(StoreUnavailableError):
            await held.commit(60.0)
        assert _checked_out(store) == 0
        assert await _count(store, at) == 0
    finally:
        await store.close()


async def test_the_embedded_store_fires_at_the_tick_only(sqlite_database_url: str) -> None:
    store = open_store(sqlite_database_url)
    try:
        planned = await _jobs(store)
        at = await _tick(store)
        assert await store.fire_ahead(await _lease(store), _records(at), planned=planned) is None
    finally:
        await store.close()


async def test_the_leader_commits_each_tick_at_its_time_never_before(
    pg_store: SqlStore, memory_bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On Postgres the scheduler writes each tick ahead (its records say the tick itself) and
    sends its commit just before the tick (``COMMIT_EARLY_S``): the database commits it at the
    tick, so a session reading all along first sees each tick's instance at or after its time,
    on the database's clock, and the leader counts the lag to the commit."""
    await define(pg_store, "tick", cron="* * * * * *")
    first_seen: dict[datetime, datetime] = {}
    stop = asyncio.Event()
    # How long before its tick each commit was sent, on this machine's clock (the database's).
    sent_early_s: list[float] = []
    commit = PostgresHeldFire.commit

    async def timed_commit(held: PostgresHeldFire, within_s: float) -> list[Instance]:
        sent_early_s.append(held._at.timestamp() - time.time())
        return await commit(held, within_s)

    monkeypatch.setattr(PostgresHeldFire, "commit", timed_commit)

    async def watch() -> None:
        query = "SELECT scheduled_at, clock_timestamp() FROM job_instances WHERE job_key = 'tick'"
        async with pg_store.engine.connect() as conn:
            while not stop.is_set():
                for tick, now in (await conn.execute(text(query))).all():
                    first_seen.setdefault(tick, now)
                await conn.commit()  # (a new snapshot for the next read)
                await asyncio.sleep(0.005)

    collector_paused = False

    async def watch_collector() -> None:
        nonlocal collector_paused
        while not stop.is_set():
            collector_paused |= not gc.isenabled()
            await asyncio.sleep(0.005)

    watching = asyncio.ensure_future(asyncio.gather(watch(), watch_collector()))
    try:
        async with running_scheduler(pg_store, memory_bus) as scheduler:

            async def four_and_one_sent_early() -> bool:
                # (A wake-up later than COMMIT_EARLY_S, on a busy machine, sends its commit
                # after the tick: wait for one that came in time.)
                early = any(0 < e <= COMMIT_EARLY_S + 0.01 for e in sent_early_s)
                return len(first_seen) >= 4 and early

            await wait_for(four_and_one_sent_early, timeout_s=30, what="a commit sent early")
            lags = scheduler.metrics.registry.get_sample_value(
                "jobplane_scheduler_fire_lag_seconds_sum"
            )
    finally:
        stop.set()
        await watching
    page = await pg_store.list_instances(InstanceFilter(job_key="tick"), limit=100)
    written_ahead = [i for i in page.items if i.created_at == i.scheduled_at]
    # (The first ticks after the start, and any the leader reached late on a busy machine,
    # are fired at their time: the others were written ahead.)
    assert written_ahead, [(i.scheduled_at, i.created_at) for i in page.items]
    for tick, seen in first_seen.items():
        assert seen >= tick, f"the tick of {tick} was seen at {seen}, before its time"
    assert lags is not None and lags > 0
    # The collector waits while a tick is held, and runs again after.
    assert collector_paused and gc.isenabled()


async def test_a_leader_that_reaches_a_held_tick_late_records_when_it_fired(
    pg_store: SqlStore, memory_bus: Bus
) -> None:
    """The leader's event loop stalls across a tick it holds: woken more than
    ``COMMIT_WITHIN_S`` late, it does not commit the tick as if on time (its records would
    say the tick); it gives the write up and fires the tick as any tick is, recording when
    that was. The tick is fired once."""
    await define(pg_store, "tick", cron="* * * * * *")
    async with running_scheduler(pg_store, memory_bus) as scheduler:

        async def holding() -> bool:
            duties = scheduler._leader
            return duties is not None and duties._held is not None

        await wait_for(holding, timeout_s=15, what="a tick written ahead")
        # Held, so not committed yet; from here on the event loop is blocked (no await) past
        # the tick (the database's clock is this machine's).
        assert scheduler._leader is not None and scheduler._leader._held is not None
        stalled = scheduler._leader._held.at
        wait = stalled.timestamp() - time.time()
        time.sleep(max(0.0, wait) + 0.2)  # noqa: ASYNC251 (the stall: blocks the event loop)

        async def fired() -> bool:
            return await _count(pg_store, stalled) == 1

        await wait_for(fired, timeout_s=10, what="the stalled tick")
    page = await pg_store.list_instances(InstanceFilter(job_key="tick"), limit=100)
    [late] = [i for i in page.items if i.scheduled_at == stalled]
    assert (late.created_at - stalled).total_seconds() >= COMMIT_WITHIN_S
    [created] = await pg_store.transitions(late.id)
    assert (created.at - stalled).total_seconds() >= COMMIT_WITHIN_S
