"""A worker cut off from Postgres (a partition: a TCP proxy that stops forwarding) fences
itself: it stops its attempt before the lease it can no longer renew ends, so when the reaper
hands the instance to another worker the two copies never overlap."""

from __future__ import annotations

import asyncio
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from jobplane.bus.factory import open_bus
from jobplane.dispatch import Dispatcher
from jobplane.settings import SessionLimits
from jobplane.store.factory import open_store
from jobplane.store.sql import SqlStore
from tests.chaos.servers import ChaosProxy
from tests.cli_helpers import output_of, spawn_cli, stop_all
from tests.fixtures.proxy import TcpProxy
from tests.worker_helpers import wait_for

pytestmark = [pytest.mark.long, pytest.mark.timeout(120)]

LEASE_S = 3.0


@pytest.fixture
async def proxy(postgres_url: str) -> AsyncIterator[TcpProxy]:
    url = make_url(postgres_url)
    running = TcpProxy(url.host or "127.0.0.1", url.port or 5432)
    await running.start()
    yield running
    await running.close()


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    stop_all(started)


def _notes(path: Path) -> list[tuple[float, str, int, int]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        at, what, attempt, pid = line.split()
        out.append((float(at), what, int(attempt), int(pid)))
    return out


async def test_a_store_call_cancelled_on_a_cut_connection_returns_at_once(
    pg_database_url: str, proxy: TcpProxy
) -> None:
    """The fence cancels an async job awaiting its checkpoint; the job must stop then, not
    when the connection the partition cut is closed. SQLAlchemy's graceful close waited 2 s
    for a cancel request the partition held: the job ran on 2 s past its fence."""
    limits = SessionLimits(
        lock_timeout_s=1, idle_in_transaction_timeout_s=1, statement_timeout_s=30, keepalive_s=1
    )
    behind = make_url(pg_database_url).set(host="127.0.0.1", port=proxy.port)
    store = open_store(behind.render_as_string(hide_password=False), limits=limits)
    try:
        assert await store.save_checkpoint(uuid.uuid4(), 1, {"step": 0}) is False  # pooled
        proxy.cut()
        call = asyncio.create_task(store.save_checkpoint(uuid.uuid4(), 1, {"step": 1}))
        await asyncio.sleep(0.5)
        assert not call.done()  # no answer: hung on the cut connection
        cancelled_at = time.monotonic()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert time.monotonic() - cancelled_at < 0.3
        proxy.heal()
        # The dropped connection is replaced: the store works again.
        assert await store.save_checkpoint(uuid.uuid4(), 1, {"step": 2}) is False
    finally:
        proxy.heal()
        await store.close()


@pytest.mark.parametrize("job", ["holds", "checkpoints", "checkpoints_sync"])
async def test_a_partitioned_worker_stops_its_attempt_before_another_runs_it(
    job: str,
    pg_store: SqlStore,
    pg_database_url: str,
    redis_url: str,
    redis_prefix: str,
    proxy: TcpProxy,
    procs: list[subprocess.Popen[str]],
    tmp_path: Path,
) -> None:
    env = {
        "JOBPLANE_REDIS_URL": redis_url,
        "JOBPLANE_KEY_PREFIX": redis_prefix,
        "JOBPLANE_HEARTBEAT_S": "0.5",
        "JOBPLANE_LEASE_S": str(LEASE_S),
        "JOBPLANE_POLL_MS": "100",
        # The cut-off worker still reads Redis: an entry it takes while its claim hangs is
        # reclaimed by the healthy one once idle this long.
        "JOBPLANE_RECLAIM_IDLE_S": "2",
        "JOBPLANE_LEASE_TTL_S": "1.5",
        "JOBPLANE_SWEEP_INTERVAL_S": "0.2",
        # No grace after the leader's start before it releases expired leases (6 s by
        # default): the release follows the lease's end as closely as it can.
        "JOBPLANE_REAP_GRACE_S": "0",
    }
    behind_proxy = make_url(pg_database_url).set(port=proxy.port)
    app = ("--app", "tests.apps.fencing:app")
    cut_off = spawn_cli(
        "worker",
        *app,
        "--worker-id",
        "cut-off",
        JOBPLANE_DATABASE_URL=behind_proxy.render_as_string(hide_password=False),
        **env,
    )
    procs.append(cut_off)
    procs.append(spawn_cli("scheduler", JOBPLANE_DATABASE_URL=pg_database_url, **env))

    async def registered() -> bool:
        return bool(await pg_store.list_definitions([job]))

    await wait_for(registered, timeout_s=60, what="the job's registration")
    notes = tmp_path / "notes.txt"
    bus = open_bus(redis_url, redis_prefix)
    try:
        await Dispatcher(pg_store, bus).trigger(job, {"path": str(notes)})
    finally:
        await bus.close()

    async def started(attempt: int) -> bool:
        return any(what == "start" and a == attempt for _, what, a, _ in _notes(notes))

    await wait_for(lambda: started(1), timeout_s=30, what="the first attempt")
    healthy = spawn_cli(
        "worker", *app, "--worker-id", "healthy", JOBPLANE_DATABASE_URL=pg_database_url, **env
    )
    procs.append(healthy)

    async def ready() -> bool:
        return " ready: queues " in output_of(healthy)

    # Ready before the cut, so that it claims the instance as soon as the reaper releases it
    # (started at the cut, its start-up hid a fenced copy that stopped 2 s late).
    await wait_for(ready, timeout_s=60, what="the healthy worker")
    proxy.cut()  # the first worker hears nothing from Postgres from now on

    async def stopped_and_started_elsewhere() -> bool:
        seen = {(what, a) for _, what, a, _ in _notes(notes)}
        return {("stop", 1), ("start", 2)} <= seen

    await wait_for(stopped_and_started_elsewhere, timeout_s=60, what="both attempts")
    by = {(what, attempt): (at, pid) for at, what, attempt, pid in _notes(notes)}
    first_stopped_at, first_pid = by[("stop", 1)]
    second_started_at, second_pid = by[("start", 2)]
    assert first_pid == cut_off.pid and second_pid != cut_off.pid
    # The cut-off copy stopped before the other one started: never two at once.
    assert first_stopped_at < second_started_at, _notes(notes)
    assert cut_off.poll() is None  # the worker itself keeps running


async def test_a_claim_answered_after_its_lease_could_end_never_starts_the_job(
    pg_store: SqlStore,
    pg_database_url: str,
    redis_url: str,
    redis_prefix: str,
    procs: list[subprocess.Popen[str]],
    tmp_path: Path,
) -> None:
    """A partition that holds the bytes (as TCP does) and then heals delivers a claim's
    answer late: by then the lease may have ended and another worker may run the instance.
    The worker must not start the code of such a claim (the chaos suite saw two copies
    overlap this way). Here every answer from Postgres is held longer than the lease."""
    url = make_url(pg_database_url)
    slow = ChaosProxy(url.port or 5432)
    await slow.start()
    try:
        env = {
            "JOBPLANE_REDIS_URL": redis_url,
            "JOBPLANE_KEY_PREFIX": redis_prefix,
            "JOBPLANE_HEARTBEAT_S": "0.1",
            "JOBPLANE_LEASE_S": "0.3",
            "JOBPLANE_POLL_MS": "100",
            "JOBPLANE_LEASE_TTL_S": "1.5",
            "JOBPLANE_SWEEP_INTERVAL_S": "0.2",
            # The leader's store never fails here: no grace before it releases expired leases
            # (by default 6 s from its start, which held back the release this test waits for).
            "JOBPLANE_REAP_GRACE_S": "0",
        }
        behind = url.set(host="127.0.0.1", port=slow.port).render_as_string(hide_password=False)
        worker = spawn_cli(
            "worker", "--app", "tests.apps.fencing:app", JOBPLANE_DATABASE_URL=behind, **env
        )
        procs.append(worker)
        procs.append(spawn_cli("scheduler", JOBPLANE_DATABASE_URL=pg_database_url, **env))

        async def ready() -> bool:
            return " ready: queues " in output_of(worker)

        await wait_for(ready, timeout_s=60, what="the worker to be ready")
        # Each chunk now waits 0.15 s each way: a claim's answer arrives 0.3 s or more after
        # it was sent, when the 0.3 s lease it starts may have ended. (Every round trip of the
        # worker takes that long, its two claims and its reconnections included: 1 s each way
        # made this test last forty seconds, 0.5 s each way with a 1 s lease twenty.)
        slow.delay_s = 0.15
        notes = tmp_path / "notes.txt"
        bus = open_bus(redis_url, redis_prefix)
        try:
            instance = await Dispatcher(pg_store, bus).trigger("holds", {"path": str(notes)})
        finally:
            await bus.close()

        async def claimed_twice() -> bool:
            history = await pg_store.transitions(instance.id)
            return sum(t.to_state.value == "processing" for t in history) >= 2

        # Claimed, its lease ended unrenewed (the reaper released it), claimed again.
        await wait_for(claimed_twice, timeout_s=60, what="two claims of the instance")
        assert _notes(notes) == []  # its code never started
        assert "answered after its lease could end" in output_of(worker)
    finally:
        slow.delay_s = 0.0
        stop_all(procs)
        procs.clear()
        await slow.close()
