"""A sync job that ignores its timeout, on Postgres and Redis: its attempt ends Failed on time,
while the job's slot and the worker's thread stay held until its code really returns."""

from __future__ import annotations

import asyncio
from pathlib import Path
from uuid import UUID

import pytest

from jobplane.bus.abc import Bus
from jobplane.dispatch import Dispatcher
from jobplane.domain.states import InstanceState as S
from jobplane.store.sql import SqlStore
from jobplane_worker.worker import Worker
from tests.apps.basic import app
from tests.store_helpers import slots_used
from tests.worker_helpers import running_worker, settled, wait_for

pytestmark = pytest.mark.timeout(120)

TIMEOUT_S = 1.0  # runaway_retried's timeout
GRACE_S = 0.5
MARGIN_S = 1.5


async def test_a_sync_runaway_fails_on_time_and_its_retry_waits_for_its_thread(
    pg_store: SqlStore, redis_bus: Bus, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    log = tmp_path / "gate.log"
    loop = asyncio.get_running_loop()
    async with running_worker(app, pg_store, redis_bus, timeout_grace_s=GRACE_S) as worker:
        instance = await Dispatcher(pg_store, redis_bus).trigger(
            "runaway_retried", {"path": str(gate)}
        )
        await wait_for(lambda: _has_line(log, "start 1"), what="the first attempt to start")
        started = loop.time()
        await wait_for(lambda: _failed(pg_store, instance.id), what="the timeout to be recorded")
        assert loop.time() - started < TIMEOUT_S + GRACE_S + MARGIN_S
        assert not await _has_line(log, "end 1")  # recorded while its code still runs

        # The retry finds the job's only slot held by that code: it waits (on_limit=wait),
        # and so does the worker's thread, which counts against the worker's own limit.
        await asyncio.sleep(1.0)
        waiting = await pg_store.get_instance(instance.id)
        assert waiting.state is S.ENQUEUED and waiting.attempt == 1 and waiting.retries_used == 1
        assert await slots_used(pg_store, "runaway_retried") == 1
        assert worker.runaway_count == 1
        assert not await _has_line(log, "start 2")

        gate.touch()  # the runaway's code returns at last
        [done] = await settled(pg_store, [instance.id], timeout_s=30)
        await wait_for(lambda: _runaways_gone(worker), what="the runaway to be let go")
        # The heartbeat left the recorded attempt alone: no lease was seen lost.
        assert _sample(worker, "jobplane_worker_lease_lost_writes_total", write="heartbeat") == 0
        assert _sample(worker, "jobplane_worker_runaways_total", job="runaway_retried") == 1
    assert done.state is S.SUCCEEDED and done.attempt == 2 and done.retries_used == 1
    lines = await asyncio.to_thread(log.read_text)
    assert [line.split()[:2] for line in lines.splitlines()] == [
        ["start", "1"],
        ["end", "1"],
        ["start", "2"],
    ]
    assert "cancelled=True" in lines  # it was told, and ignored it
    history = await pg_store.transitions(instance.id)
    steps = [(t.from_state, t.to_state, t.reason) for t in history]
    assert steps == [
        (None, S.ENQUEUED, None),
        (S.ENQUEUED, S.PROCESSING, None),
        (S.PROCESSING, S.FAILED, "timeout"),
        (S.FAILED, S.ENQUEUED, "retry 1 of 1"),
        (S.ENQUEUED, S.PROCESSING, None),
        (S.PROCESSING, S.SUCCEEDED, None),
    ]
    failed_at, retried_at = history[2].at, history[4].at
    assert (retried_at - failed_at).total_seconds() >= 1.0  # it waited for the thread
    assert await slots_used(pg_store, "runaway_retried") == 0


async def _has_line(path: Path, prefix: str) -> bool:
    def read() -> bool:
        return path.exists() and any(
            line.startswith(prefix) for line in path.read_text().splitlines()
        )

    return await asyncio.to_thread(read)


async def _failed(store: SqlStore, instance_id: UUID) -> bool:
    return any(t.to_state is S.FAILED for t in await store.transitions(instance_id))


async def _runaways_gone(worker: Worker) -> bool:
    return worker.runaway_count == 0


def _sample(worker: Worker, name: str, **labels: str) -> float:
    return float(worker.metrics.registry.get_sample_value(name, labels) or 0.0)
