"""Schedulers as real processes: leaders killed (SIGKILL) and stopped (SIGTERM) mid-run, and a
Redis that restarts empty. Invariants are checked in the database afterwards."""

from __future__ import annotations

import asyncio
import itertools
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from jobplane.bus.factory import open_bus
from jobplane.bus.redis import RedisBus
from jobplane.dispatch import Dispatcher
from jobplane.domain.models import Instance, InstanceFilter
from jobplane.domain.states import InstanceState as S
from jobplane.store.sql import SqlStore
from tests.apps.ticks import POLICIES
from tests.cli_helpers import free_port, spawn_cli, stop_all, wait_for_output
from tests.fixtures.private_servers import redis_command
from tests.worker_helpers import settled, wait_for

pytestmark = pytest.mark.timeout(240)

Spawn = Callable[..., subprocess.Popen[str]]


@pytest.fixture
def spawn(pg_database_url: str, redis_url: str, redis_prefix: str) -> Iterator[Spawn]:
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str, **env: str) -> subprocess.Popen[str]:
        settings = {
            "JOBPLANE_DATABASE_URL": pg_database_url,
            "JOBPLANE_REDIS_URL": redis_url,
            "JOBPLANE_KEY_PREFIX": redis_prefix,
            "JOBPLANE_LEASE_TTL_S": "1.5",
            "JOBPLANE_SWEEP_INTERVAL_S": "0.2",
            "JOBPLANE_REPUBLISH_AFTER_S": "1",
            "JOBPLANE_HEARTBEAT_S": "0.2",
            "JOBPLANE_POLL_MS": "100",
            **env,
        }
        proc = spawn_cli(*args, **settings)
        procs.append(proc)
        return proc

    yield start
    stop_all(procs)


async def _leader_pid(store: SqlStore) -> int | None:
    lease = await store.get_leader(0)
    return int(lease.holder.rsplit(":", 1)[1]) if lease else None


CAMPAIGNING = "campaigning for shard 0"


@pytest.mark.long
async def test_every_tick_fires_exactly_once_through_leader_kills(
    pg_store: SqlStore, spawn: Spawn
) -> None:
    """Two schedulers and a worker; the leader is killed (SIGKILL) or stopped (SIGTERM) every
    ~2.5 s and replaced, four times each. Afterwards, in the database: every one-second tick of
    four jobs is recorded exactly once, without a gap, up to the end; the ones not fired are
    Skipped ("misfire") as the job's policy says, only across failovers, and every fired one
    ran."""
    worker = spawn("worker", "--app", "tests.apps.ticks:app", "--worker-id", "ticks-w")

    async def registered() -> bool:
        return len(await pg_store.list_definitions(POLICIES.keys())) == len(POLICIES)

    await wait_for(registered, timeout_s=60, what="the worker to register the tick jobs")

    async def start_scheduler() -> subprocess.Popen[str]:
        # A lease long enough that every SIGKILL's takeover comes more than the jobs' misfire
        # grace (1 s) after the next tick: TTL 3.5 s, renewed every 1.17 s, so the lease runs
        # out 2.3 s or more after a kill.
        proc = spawn("scheduler", JOBPLANE_LEASE_TTL_S="3.5")
        # Signals are handled from here on (an earlier SIGTERM is held until then too).
        await wait_for_output(proc, CAMPAIGNING)
        return proc

    schedulers = {p.pid: p for p in [await start_scheduler(), await start_scheduler()]}
    started = time.monotonic()
    kills: list[signal.Signals] = []
    while len(kills) < 8:  # four of each, over 30-40 s
        await wait_for(lambda: _has_leader(pg_store), timeout_s=15, what="a leader")
        await asyncio.sleep(2.5)
        pid = await _leader_pid(pg_store)
        if pid not in schedulers:
            continue
        sig = signal.SIGKILL if len(kills) % 2 == 0 else signal.SIGTERM
        leader = schedulers.pop(pid)
        leader.send_signal(sig)
        assert leader.wait(timeout=30) == (-signal.SIGKILL if sig is signal.SIGKILL else 0)
        kills.append(sig)
        replacement = await start_scheduler()
        schedulers[replacement.pid] = replacement
    await wait_for(lambda: _has_leader(pg_store), timeout_s=15, what="a last leader")
    # The last leader fires for 3 s at least, and the whole run lasts long enough for every job
    # to record the 30 ticks checked below (roles that start faster make the failovers, and so
    # the kills, come sooner).
    await asyncio.sleep(max(3.0, RUN_S - (time.monotonic() - started)))
    still_firing_at = await pg_store.now() - timedelta(seconds=2)
    for proc in schedulers.values():
        proc.send_signal(signal.SIGTERM)
    for proc in schedulers.values():
        assert proc.wait(timeout=30) == 0

    # No instance is lost: every fired tick runs (a leader killed between recording a tick
    # and publishing it leaves it to the next leader's sweep).
    fired = await pg_store.list_instances(
        InstanceFilter(states=(S.ENQUEUED, S.PROCESSING)), limit=10_000
    )
    await settled(pg_store, [i.id for i in fired.items], timeout_s=60)
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=60) == 0

    records = {
        key: (await pg_store.list_instances(InstanceFilter(job_key=key), limit=10_000)).items
        for key in POLICIES
    }
    for key, instances in records.items():
        _check_record(key, instances, still_firing_at)
    skipped = {key: _skipped(instances) for key, instances in records.items()}
    assert skipped["tick_all"] == [], "fire_all skipped a tick"
    for key in ("tick_once", "tick_once_2", "tick_skip"):
        # Ticks are missed only across a failover: one stretch of Skipped each at most.
        ticks = skipped[key]  # each paired with the one before it (None for the first)
        stretches = sum(1 for a, b in zip([None, *ticks], ticks, strict=False) if _apart(a, b))
        assert stretches <= len(kills), (key, skipped[key])
        if key == "tick_skip":
            # Every SIGKILL misses a tick at least (the lease runs out more than the grace
            # after the next tick), which skip records.
            assert stretches >= kills.count(signal.SIGKILL), skipped[key]
    for key in ("tick_once", "tick_once_2"):
        # fire_once fires the latest missed tick of each stretch that skip records Skipped.
        assert len(skipped[key]) < len(skipped["tick_skip"]), skipped


#: How long the scenario runs at least, from the first scheduler's start: over 30 ticks.
RUN_S = 33.0


def _check_record(key: str, instances: list[Instance], still_firing_at: datetime) -> None:
    """One tick job's record: every second exactly once, up to the end, each tick Skipped
    ("misfire") or run (it returns the tick it ran for)."""
    record = sorted(instances, key=_tick)
    ticks = [_tick(i) for i in record]
    assert len(ticks) == len(set(ticks)), f"{key}: a tick fired twice"
    gaps = {b - a for a, b in itertools.pairwise(ticks)}
    assert gaps == {timedelta(seconds=1)}, f"{key}: a tick went missing"
    assert ticks[-1] >= still_firing_at, f"{key}: firing stopped before the end"
    assert len(ticks) >= 30
    for i in record:
        if i.state is S.SKIPPED:
            assert i.reason == "misfire"
        else:
            assert i.state is S.SUCCEEDED, f"{key}: {i.id} ended {i.state}"
            assert i.result == _tick(i).isoformat()


def _tick(instance: Instance) -> datetime:
    """A tick job's instance's tick (every one has one)."""
    assert instance.scheduled_at is not None, instance
    return instance.scheduled_at


def _skipped(instances: list[Instance]) -> list[datetime]:
    return sorted(i.scheduled_at for i in instances if i.state is S.SKIPPED and i.scheduled_at)


def _apart(a: datetime | None, b: datetime) -> bool:
    """``b`` starts a new stretch of Skipped ticks (it does not follow ``a`` by one second)."""
    return a is None or b - a != timedelta(seconds=1)


async def _has_leader(store: SqlStore) -> bool:
    return await store.get_leader(0) is not None


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[tuple[str, Callable[[], None]]]:
    """A Redis server of this test's own, which the test may restart empty."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    args = redis_command(binary, port, "--dir", str(tmp_path))
    state = {"proc": subprocess.Popen(args, stdout=subprocess.DEVNULL)}

    def restart_empty() -> None:
        state["proc"].kill()
        state["proc"].wait(timeout=10)
        state["proc"] = subprocess.Popen(args, stdout=subprocess.DEVNULL)

    yield f"redis://127.0.0.1:{port}/0", restart_empty
    state["proc"].kill()
    state["proc"].wait(timeout=10)


async def test_redis_restarting_empty_loses_no_instance(
    pg_store: SqlStore,
    spawn: Spawn,
    own_redis: tuple[str, Callable[[], None]],
    redis_prefix: str,
) -> None:
    url, restart_empty = own_redis
    await wait_for(lambda: _redis_up(url), timeout_s=10, what="redis")
    env = {"JOBPLANE_REDIS_URL": url}
    spawn("scheduler", **env)
    worker = spawn("worker", "--app", "tests.apps.basic:app", "--worker-id", "w-a", **env)
    await wait_for(lambda: _has_leader(pg_store), timeout_s=15, what="a leader")
    await wait_for(lambda: _defined(pg_store), timeout_s=15, what="job registration")
    # The roles' key prefix: triggers go to the streams the worker reads.
    bus = open_bus(url, redis_prefix)
    dispatcher = Dispatcher(pg_store, bus)
    try:
        warm = [await dispatcher.trigger("echo", {"value": i}) for i in range(5)]
        await settled(pg_store, [i.id for i in warm], timeout_s=30)
        worker.send_signal(signal.SIGSTOP)  # the worker cannot consume the next batch...
        first = [await dispatcher.trigger("echo", {"value": i}) for i in range(20)]
        restart_empty()  # ...and Redis loses it: streams, groups, pending entries
        await wait_for(lambda: _redis_up(url), timeout_s=10, what="redis again")
        worker.send_signal(signal.SIGCONT)
        second = [await dispatcher.trigger("echo", {"value": i}) for i in range(20)]
    finally:
        await bus.close()
    # The leader sees the new Redis run id and republishes every Enqueued instance; the
    # worker reconnects and recreates its consumer groups.
    done = await settled(pg_store, [i.id for i in first + second], timeout_s=90)
    assert {i.state for i in done} == {S.SUCCEEDED}
    assert {i.worker_id for i in done} == {"w-a"}


async def _redis_up(url: str) -> bool:
    bus = open_bus(url)
    try:
        await bus.ping()
        return True
    except Exception:
        return False
    finally:
        await bus.close()


async def _defined(store: SqlStore) -> bool:
    """The worker registers its row after every job definition."""
    return bool(await store.list_workers())


async def test_redis_flushed_live_loses_no_instance(
    pg_store: SqlStore,
    spawn: Spawn,
    own_redis: tuple[str, Callable[[], None]],
    redis_prefix: str,
) -> None:
    url, _ = own_redis
    await wait_for(lambda: _redis_up(url), timeout_s=10, what="redis")
    # Republishing by age would take 30 s: a flush must be noticed well before that.
    env = {"JOBPLANE_REDIS_URL": url}
    spawn("scheduler", **env, JOBPLANE_REPUBLISH_AFTER_S="30")
    worker = spawn("worker", "--app", "tests.apps.basic:app", "--worker-id", "w-a", **env)
    await wait_for(lambda: _has_leader(pg_store), timeout_s=15, what="a leader")
    await wait_for(lambda: _defined(pg_store), timeout_s=15, what="job registration")
    # The roles' key prefix: triggers go to the streams the worker reads (under another
    # prefix every batch waited for the 30 s republish by age, the flush's included).
    bus = open_bus(url, redis_prefix)
    dispatcher = Dispatcher(pg_store, bus)
    assert isinstance(bus, RedisBus)
    try:
        warm = [await dispatcher.trigger("echo", {"value": i}) for i in range(5)]
        await settled(pg_store, [i.id for i in warm], timeout_s=20)
        await asyncio.sleep(1)  # the leader has written its marker by now (sweep: 0.2 s)
        worker.send_signal(signal.SIGSTOP)  # the worker cannot consume the next batch...
        first = [await dispatcher.trigger("echo", {"value": i}) for i in range(20)]
        await bus.client.flushall()  # ...and a live Redis loses it; its run_id stays
        flushed_at = await pg_store.now()

        async def republished() -> bool:
            found = [await pg_store.get_instance(i.id) for i in first]
            return all(i.published_at and i.published_at > flushed_at for i in found)

        # The leader sees the marker gone at its next sweep and republishes at once.
        await wait_for(republished, timeout_s=5, what="the republish after the flush")
        worker.send_signal(signal.SIGCONT)
        second = [await dispatcher.trigger("echo", {"value": i}) for i in range(20)]
    finally:
        await bus.close()
    # The worker recreates its consumer groups (NOGROUP) and runs everything, well before the
    # republish by age (30 s) could have hidden a worker that did not.
    done = await settled(pg_store, [i.id for i in first + second], timeout_s=25)
    assert {i.state for i in done} == {S.SUCCEEDED}
