"""``isolation="process"``: progress and checkpoints cross the process boundary, on Postgres
and Redis, through the same fenced writes as in-process jobs."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path

import pytest

from jobplane.bus.abc import Bus
from jobplane.dispatch import Dispatcher
from jobplane.domain.models import Instance
from jobplane.domain.states import InstanceState as S
from jobplane.store.sql import SqlStore
from jobplane_worker.worker import Worker
from tests.apps.basic import CHILD_TIMEOUT_S, app
from tests.worker_helpers import running_worker, settled, wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    ("key", "step", "fraction"), [("child_resumes", 10, 0.5), ("child_resumes_async", 5, 0.25)]
)
async def test_isolated_job_reports_progress_and_resumes_from_its_checkpoint(
    pg_store: SqlStore, redis_bus: Bus, key: str, step: int, fraction: float
) -> None:
    async with running_worker(app, pg_store, redis_bus):
        instance = await Dispatcher(pg_store, redis_bus).trigger(key)
        [done] = await settled(pg_store, [instance.id], timeout_s=60)
    # The first attempt saved `step` and failed; the retry started from it and saved twice that.
    assert done.state is S.SUCCEEDED, done.error
    assert done.attempt == 2 and done.retries_used == 1
    assert done.result == {"resumed_from": step}
    assert done.checkpoint == 2 * step
    assert done.progress == fraction and done.progress_message == f"from {step}"
    steps = [t.to_state for t in await pg_store.transitions(instance.id)]
    assert steps.count(S.FAILED) == 1 and steps[-1] is S.SUCCEEDED


async def test_isolated_checkpoint_after_a_lost_claim_is_refused(
    pg_store: SqlStore, redis_bus: Bus, tmp_path: Path
) -> None:
    """The child's checkpoint goes through the worker's fenced saver: once the instance was
    released and claimed by another worker (a newer claim token), it is refused, the child
    gets LeaseLostError, and its outcome is refused as well."""
    gate = tmp_path / "gate"
    # No heartbeat during the test: the attempt learns of its lost claim from the refusal.
    async with running_worker(app, pg_store, redis_bus, heartbeat_s=10, lease_s=60) as worker:
        instance = await Dispatcher(pg_store, redis_bus).trigger(
            "child_checkpoints_late", {"path": str(gate)}
        )
        await wait_for(lambda: _exists(Path(f"{gate}.started")), what="the child to start")
        mine = await pg_store.get_instance(instance.id)
        # What the reaper does to an expired lease, then another worker's claim.
        released = await pg_store.transition(
            instance.id,
            S.ENQUEUED,
            expect=[S.PROCESSING],
            claim_token=mine.claim_token,
            actor="test",
            reason="lease expired",
        )
        assert released is not None
        claim = await pg_store.claim([instance.id], "thief", 60, ["child_checkpoints_late"])
        assert [c.instance.id for c in claim.claimed] == [instance.id]
        gate.touch()
        await wait_for(lambda: _exists(Path(f"{gate}.result")), what="the checkpoint attempt")
        # The child raised LeaseLostError; its Failed outcome is refused by the store too.
        await wait_for(lambda: _refused(worker, "outcome"), what="the outcome to be refused")
        assert await _refused(worker, "checkpoint")
    result = await asyncio.to_thread(Path(f"{gate}.result").read_text)
    assert result.strip() == "refused"
    now = await pg_store.get_instance(instance.id)
    assert now.state is S.PROCESSING and now.worker_id == "thief" and now.checkpoint is None


async def _exists(path: Path) -> bool:
    return await asyncio.to_thread(path.exists)


async def _refused(worker: Worker, write: str) -> bool:
    value = worker.metrics.registry.get_sample_value(
        "jobplane_worker_lease_lost_writes_total", {"write": write}
    )
    return value == 1.0


async def test_an_isolated_job_sees_its_timeout_and_returns_within_the_grace(
    pg_store: SqlStore, redis_bus: Bus, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """At the timeout the child gets the signal: ``ctx.cancelled`` becomes true inside it,
    it returns within the grace and exits on its own; the attempt still timed out."""
    caplog.set_level(logging.INFO, logger="jobplane_worker.isolation")
    seen = tmp_path / "seen"
    # A grace far longer than the child needs to notice and return (3 s was overrun on a loaded
    # machine, and the child was killed): a child that returns ends the wait at once.
    async with running_worker(app, pg_store, redis_bus, timeout_grace_s=15.0):
        instance = await Dispatcher(pg_store, redis_bus).trigger(
            "child_notices_timeout", {"path": str(seen)}
        )
        [done] = await settled(pg_store, [instance.id], timeout_s=60)
    assert done.state is S.TERMINATED and done.error is not None
    assert done.error.type == "TimeoutError"
    assert await _failed_reason(pg_store, instance) == "timeout"
    assert (await asyncio.to_thread(seen.read_text)) == "cancelled by the worker"
    pid = int(await asyncio.to_thread(Path(f"{seen}.started").read_text))
    assert _exit_codes(caplog, pid) == [0]  # it ended by itself: not killed
    assert not [r for r in caplog.records if getattr(r, "action", None) == "worker.child_kill"]


async def test_an_isolated_job_that_ignores_its_signal_is_killed_after_the_grace(
    pg_store: SqlStore, redis_bus: Bus, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="jobplane_worker.isolation")
    pid_file = tmp_path / "pid"
    grace_s = 0.5
    async with running_worker(app, pg_store, redis_bus, timeout_grace_s=grace_s):
        instance = await Dispatcher(pg_store, redis_bus).trigger("runaway", {"path": str(pid_file)})
        [done] = await settled(pg_store, [instance.id], timeout_s=60)
    assert done.state is S.TERMINATED and done.error is not None
    assert done.error.type == "TimeoutError"
    assert await _failed_reason(pg_store, instance) == "timeout"
    pid = int(await asyncio.to_thread(pid_file.read_text))
    assert _exit_codes(caplog, pid) == [-signal.SIGKILL]  # SIGTERM alone did not stop it
    history = await pg_store.transitions(instance.id)
    started = next(t.at for t in history if t.to_state is S.PROCESSING)
    failed = next(t.at for t in history if t.to_state is S.FAILED)
    assert (failed - started).total_seconds() >= CHILD_TIMEOUT_S + grace_s  # then the grace
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def _failed_reason(store: SqlStore, instance: Instance) -> str | None:
    history = await store.transitions(instance.id)
    return next(t.reason for t in history if t.to_state is S.FAILED)


def _exit_codes(caplog: pytest.LogCaptureFixture, pid: int) -> list[object]:
    """Exit codes of the job process ``pid``, as the worker logged them."""
    return [
        r.args[1]
        for r in caplog.records
        if getattr(r, "action", None) == "worker.child_exited"
        and isinstance(r.args, tuple)
        and r.args[0] == pid
    ]
