"""Run a Worker inside the test's event loop, and wait for instances to settle."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Collection
from contextlib import asynccontextmanager
from typing import Any
from uuid import UUID

from jobplane.app import App
from jobplane.bus.abc import Bus
from jobplane.domain.models import Instance
from jobplane.domain.states import InstanceState
from jobplane.settings import WorkerSettings
from jobplane.store.sql import SqlStore
from jobplane_worker.worker import Worker

FAST = {
    "poll_ms": 100,
    "heartbeat_s": 0.2,
    "lease_s": 2.0,
    "reclaim_idle_s": 1.0,
    "unknown_job_delay_s": 0.1,
    "grace_s": 1.0,
    "timeout_grace_s": 0.2,
}


@asynccontextmanager
async def running_worker(
    app: App, store: SqlStore, bus: Bus, **overrides: Any
) -> AsyncIterator[Worker]:
    settings = WorkerSettings(**{"worker_id": f"w-{uuid.uuid4().hex[:8]}", **FAST, **overrides})
    worker = Worker(app, store, bus, settings)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await wait_for(lambda: _registered(store, worker.id), what="worker registration", task=task)
        yield worker
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)


async def _registered(store: SqlStore, worker_id: str) -> bool:
    return any(w.id == worker_id for w in await store.list_workers())


async def wait_for(
    predicate: Any,
    *,
    timeout_s: float = 20,
    what: str = "condition",
    task: asyncio.Task[Any] | None = None,
) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await predicate():
        if task is not None and task.done():
            task.result()  # raise the worker's error
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def settled(store: SqlStore, ids: Collection[UUID], timeout_s: float = 20) -> list[Instance]:
    """Wait until every instance is terminal; return them."""

    async def done() -> bool:
        found = [await store.get_instance(i) for i in ids]
        return all(i.state.is_terminal for i in found)

    try:
        await wait_for(done, timeout_s=timeout_s, what=f"{len(ids)} instance(s) to end")
    except AssertionError as exc:
        stuck = [i for i in [await store.get_instance(i) for i in ids] if not i.state.is_terminal]
        detail = ", ".join(
            f"{i.id} {i.state.value} published_at={i.published_at} worker={i.worker_id}"
            for i in stuck[:5]
        )
        raise AssertionError(f"{exc}; {len(stuck)} still open: {detail}") from None
    return [await store.get_instance(i) for i in ids]


def states(instances: Collection[Instance]) -> set[InstanceState]:
    return {i.state for i in instances}
