"""An isolated job's child, and what its job starts, end with its attempt, whatever ends it;
and the worker never waits on a child's exit. Real worker processes and real children."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from jobplane.bus.abc import Bus
from jobplane.context import JobContext
from jobplane.dispatch import Dispatcher
from jobplane.domain.reasons import StopReason
from jobplane.domain.states import InstanceState as S
from jobplane.store.sql import SqlStore
from jobplane_worker.isolation import run_in_child
from tests.apps.isolated import app
from tests.cli_helpers import spawn_cli_leading, stop_all
from tests.worker_helpers import running_worker, settled, wait_for

pytestmark = pytest.mark.timeout(150)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


async def _pid_in(path: Path) -> int:
    async def written() -> bool:
        return await asyncio.to_thread(lambda: path.exists() and path.stat().st_size > 0)

    await wait_for(written, timeout_s=60, what=f"{path.name} to be written")
    return int(await asyncio.to_thread(path.read_text))


Start = Callable[..., subprocess.Popen[str]]


@pytest.fixture
def start_worker(pg_database_url: str, redis_url: str, redis_prefix: str) -> Iterator[Start]:
    """Starts a ``jobplane worker`` leading its process group, as a terminal or supervisor
    starts one, with the extra arguments given; each is stopped after the test."""
    started: list[subprocess.Popen[str]] = []

    def start(*extra: str, **env: str) -> subprocess.Popen[str]:
        proc = spawn_cli_leading(
            "worker",
            "--app",
            "tests.apps.isolated:app",
            *extra,
            JOBPLANE_DATABASE_URL=pg_database_url,
            JOBPLANE_REDIS_URL=redis_url,
            JOBPLANE_KEY_PREFIX=redis_prefix,
            JOBPLANE_POLL_MS="100",
            **env,
        )
        started.append(proc)
        return proc

    yield start
    stop_all(started)


async def _registered(store: SqlStore) -> None:
    """Wait for the worker's row: it registers its jobs first, then itself."""

    async def registered() -> bool:
        return bool(await store.list_workers())

    await wait_for(registered, timeout_s=60, what="the worker's registration")


async def test_an_isolated_child_dies_with_its_sigkilled_worker(
    pg_store: SqlStore, redis_bus: Bus, start_worker: Start, tmp_path: Path
) -> None:
    """Once its worker is gone nobody can stop or record the child, and the reaper hands the
    instance to another worker when the lease ends: a child that ran on was a second copy."""
    worker = start_worker()
    await _registered(pg_store)
    gate = tmp_path / "gate"
    await Dispatcher(pg_store, redis_bus).trigger("ticks_until_killed", {"path": str(gate)})
    child = await _pid_in(Path(f"{gate}.pid"))
    try:
        worker.send_signal(signal.SIGKILL)  # the worker alone (the OOM killer, kill -9)
        await asyncio.to_thread(worker.wait, 30)

        async def gone() -> bool:
            return not _alive(child)

        await wait_for(gone, timeout_s=5, what=f"child {child} to end with its worker")
    finally:
        _kill(child)


async def test_a_command_an_isolated_job_ran_ends_with_its_attempt(
    pg_store: SqlStore, redis_bus: Bus, tmp_path: Path
) -> None:
    """At the timeout the child is stopped (SIGTERM, then SIGKILL); the command it ran (the
    usual use of isolation: wrapping a tool) ran on beside the retry."""
    gate = tmp_path / "gate"
    async with running_worker(app, pg_store, redis_bus, timeout_grace_s=0.5):
        instance = await Dispatcher(pg_store, redis_bus).trigger("shells_out", {"path": str(gate)})
        [done] = await settled(pg_store, [instance.id], timeout_s=60)
    assert done.error is not None and done.error.type == "TimeoutError"
    command = int(await asyncio.to_thread(Path(f"{gate}.command").read_text))
    try:
        await asyncio.sleep(0.5)
        assert not _alive(command), f"the job's command ({command}) outlived its attempt"
    finally:
        _kill(command)


async def test_ctrl_c_drains_an_isolated_job_like_any_other(
    pg_store: SqlStore, redis_bus: Bus, start_worker: Start, tmp_path: Path
) -> None:
    """A terminal's Ctrl-C reaches the whole foreground process group; SIGINT is the worker's
    graceful stop. The child took it too and failed its job (KeyboardInterrupt), using a
    retry, where a job that ends within the grace must succeed."""
    worker = start_worker("--grace", "20")
    await _registered(pg_store)
    gate = tmp_path / "gate"
    instance = await Dispatcher(pg_store, redis_bus).trigger(
        "finishes_in_two_seconds", {"path": str(gate)}
    )
    await _pid_in(Path(f"{gate}.started"))
    os.killpg(worker.pid, signal.SIGINT)
    assert await asyncio.to_thread(worker.wait, 40) == 0
    done = await pg_store.get_instance(instance.id)
    assert done.state is S.SUCCEEDED, (done.state, done.error)


async def test_the_end_of_an_isolated_job_never_holds_up_the_workers_loop(
    pg_store: SqlStore, redis_bus: Bus, tmp_path: Path
) -> None:
    """A child exits only once the threads its job left have ended: the worker waited for it
    on its event loop (up to 1 s per child), holding up heartbeats, the fence and every job."""
    gaps: list[float] = []

    async def ticker() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.02)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    async with running_worker(app, pg_store, redis_bus):
        dispatcher = Dispatcher(pg_store, redis_bus)
        made = [
            await dispatcher.trigger("leaves_a_thread", {"path": str(tmp_path / str(i))})
            for i in range(3)
        ]
        tick = asyncio.create_task(ticker())
        try:
            done = await settled(pg_store, [i.id for i in made], timeout_s=60)
        finally:
            tick.cancel()
    assert {i.state for i in done} == {S.SUCCEEDED}
    assert max(gaps) < 0.5, f"the worker's loop stalled {max(gaps):.2f} s"


@pytest.mark.parametrize(
    "key", ["ticks_until_killed", "raises_when_stopped", "returns_when_stopped"]
)
async def test_a_child_whose_lease_is_not_renewed_stops_itself_before_it_ends(
    key: str, tmp_path: Path
) -> None:
    """Its worker cannot stop it when frozen or blocked, and nothing renews the lease: the
    child stops itself past the fence time (SIGTERM, the job's cancellation) and kills its
    group before the lease may end, whether its job heeds the stop or not. The attempt is
    then released as the fence releases one, not failed (nor succeeded, with a partial result
    returned early) by what the stop made the job do."""
    gate = tmp_path / "gate"
    ctx = JobContext(
        instance_id=uuid.uuid4(), job_key=key, attempt=1, scheduled_at=None, worker_id="w"
    )
    started = time.monotonic()
    fence_at, until = started + 2.0, started + 3.5  # as if never renewed after the claim
    run = asyncio.create_task(
        run_in_child(app.jobs[key], ctx, {"path": str(gate)}, 120, 30, lambda: (fence_at, until))
    )
    child = await _pid_in(Path(f"{gate}.pid"))
    try:
        with pytest.raises(asyncio.CancelledError):
            await run
        assert ctx.cancellation.reason is StopReason.LEASE_LOST
        assert not _alive(child)
        assert time.monotonic() - started < 3.5 + 1.0  # (its end is awaited off the loop)
    finally:
        _kill(child)


async def test_a_frozen_workers_isolated_child_ends_before_its_lease(
    pg_store: SqlStore, redis_bus: Bus, start_worker: Start, tmp_path: Path
) -> None:
    """A worker frozen (SIGSTOP to its pid alone) neither renews its leases nor runs its
    fence: its child ran on past the lease, beside the attempt the reaper then handed to
    another worker. It now ends within the lease of the freeze; and once the worker resumes,
    the attempt is released, not failed."""
    lease_s = 4.0
    worker = start_worker(
        JOBPLANE_LEASE_S=str(lease_s), JOBPLANE_HEARTBEAT_S="0.5", JOBPLANE_TIMEOUT_GRACE_S="1"
    )
    await _registered(pg_store)
    gate = tmp_path / "gate"
    instance = await Dispatcher(pg_store, redis_bus).trigger(
        "ticks_until_killed", {"path": str(gate)}
    )
    child = await _pid_in(Path(f"{gate}.pid"))
    try:
        await asyncio.sleep(1.0)  # (a few renewals: the lease is the heartbeat's, not the claim's)
        worker.send_signal(signal.SIGSTOP)
        frozen = time.monotonic()

        async def gone() -> bool:
            return not _alive(child)

        await wait_for(gone, timeout_s=lease_s + 5, what=f"child {child} to stop itself")
        assert time.monotonic() - frozen < lease_s, "the child outlived its lease"
        worker.send_signal(signal.SIGCONT)

        async def released() -> bool:
            steps = await pg_store.transitions(instance.id)
            return any(t.from_state is S.PROCESSING and t.to_state is S.ENQUEUED for t in steps)

        await wait_for(released, timeout_s=30, what="the attempt's release")
        assert S.FAILED not in {t.to_state for t in await pg_store.transitions(instance.id)}
    finally:
        worker.send_signal(signal.SIGCONT)
        _kill(child)


async def test_a_live_workers_child_runs_on_past_many_leases(
    pg_store: SqlStore, redis_bus: Bus, tmp_path: Path
) -> None:
    """The child's own stop follows the renewals: a child running for many leases of a live
    worker is never stopped by it."""
    gate = tmp_path / "gate"
    async with running_worker(app, pg_store, redis_bus, lease_s=1.0, heartbeat_s=0.2):
        instance = await Dispatcher(pg_store, redis_bus).trigger(
            "finishes_in_two_seconds", {"path": str(gate)}
        )
        [done] = await settled(pg_store, [instance.id], timeout_s=60)
    assert done.state is S.SUCCEEDED and done.attempt == 1, (done.state, done.error)
