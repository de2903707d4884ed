"""Run a Worker inside the test's event loop, and wait for instances to settle."""

from __future__ import annotations

import asyncio
import inspect
import uuid
from collections.abc import AsyncIterator, Collection, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypedDict, cast
from uuid import UUID

from jobplane.app import App
from jobplane.bus.abc import Bus, Consumer, Delivery
from jobplane.domain.models import Instance
from jobplane.domain.states import InstanceState
from jobplane.errors import BusUnavailableError, StoreUnavailableError
from jobplane.store.abc import DispatchStore, Store, WorkerStore
from jobplane_worker.settings import WorkerSettings
from jobplane_worker.worker import Worker


class Timings(TypedDict):
    """The worker settings that :data:`FAST` shortens (typed, so ``**FAST`` is checked)."""

    poll_ms: int
    heartbeat_s: float
    lease_s: float
    reclaim_idle_s: float
    unknown_job_delay_s: float
    grace_s: float
    timeout_grace_s: float


FAST: Timings = {
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
    app: App, store: WorkerStore | FlakyStore, bus: Bus | Any, **overrides: Any
) -> AsyncIterator[Worker]:
    settings = WorkerSettings(**{"worker_id": f"w-{uuid.uuid4().hex[:8]}", **FAST, **overrides})
    # (A FlakyStore is the real store behind a proxy that fails some of its calls.)
    worker = Worker(app, cast(WorkerStore, store), bus, settings)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await wait_for(
            lambda: _registered(worker.store, worker.id), what="worker registration", task=task
        )
        yield worker
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)


async def _registered(store: Any, worker_id: str) -> bool:
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


async def settled(
    store: DispatchStore, ids: Collection[UUID], timeout_s: float = 20
) -> list[Instance]:
    """Wait until every instance is terminal; return them. (An instance stays terminal once
    it is, so each look reads only those not yet seen terminal: reading every one of a few
    hundred instances every 20 ms kept a core busy until the last one ended.)"""
    open_ids = set(ids)

    async def done() -> bool:
        for instance_id in list(open_ids):
            if (await store.get_instance(instance_id)).state.is_terminal:
                open_ids.discard(instance_id)
        return not open_ids

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


class FlakyStore:
    """The real store, but the methods named in ``down`` fail as if Postgres were unreachable
    (:class:`StoreUnavailableError`, nothing sent), as do the next ``fail_next[name]`` calls of
    a method. Every refused call is kept in ``refused`` as ``(name, args)``."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.down: set[str] = set()
        #: Every method fails (a whole outage), as if each were in ``down``.
        self.all_down = False
        self.fail_next: dict[str, int] = {}
        self.refused: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        real = getattr(self.store, name)
        if not inspect.iscoroutinefunction(real):
            return real

        async def call(*args: Any, **kwargs: Any) -> Any:
            if self.all_down or name in self.down or self.fail_next.get(name, 0) > 0:
                if self.fail_next.get(name, 0) > 0:
                    self.fail_next[name] -= 1
                self.refused.append((name, args))
                raise StoreUnavailableError(f"metadata store unavailable (injected: {name})")
            return await real(*args, **kwargs)

        return call

    def refusals(self, name: str) -> list[tuple[Any, ...]]:
        return [args for refused, args in self.refused if refused == name]


class FlakyAckBus:
    """The real bus; its consumers' next ``ack_failures`` acks fail as if Redis were away
    (nothing is sent). ``acks_refused`` counts them."""

    def __init__(self, bus: Bus, ack_failures: int) -> None:
        self.bus = bus
        self.ack_failures = ack_failures
        self.acks_refused = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.bus, name)

    def consumer(self, worker_id: str, queues: Sequence[str]) -> Consumer:
        return _FlakyConsumer(self, self.bus.consumer(worker_id, queues))


class _FlakyConsumer:
    def __init__(self, owner: FlakyAckBus, consumer: Consumer) -> None:
        self.owner = owner
        self.consumer = consumer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.consumer, name)

    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        if self.owner.ack_failures > 0:
            self.owner.ack_failures -= 1
            self.owner.acks_refused += 1
            raise BusUnavailableError("Redis unavailable (injected: ack)")
        await self.consumer.ack(deliveries)


class StopDuringReadBus:
    """The real bus; when one of its consumers' reads returns entries, ``stop`` is set before
    the worker gets them (a SIGTERM that arrives while a read is in flight)."""

    def __init__(self, bus: Bus, stop: asyncio.Event) -> None:
        self.bus = bus
        self.stop = stop
        self.returned: list[Delivery] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.bus, name)

    def consumer(self, worker_id: str, queues: Sequence[str]) -> Consumer:
        return _StopDuringRead(self, self.bus.consumer(worker_id, queues))


class _StopDuringRead:
    def __init__(self, owner: StopDuringReadBus, consumer: Consumer) -> None:
        self.owner = owner
        self.consumer = consumer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.consumer, name)

    async def read(self, count: int, block_ms: int) -> list[Delivery]:
        found = await self.consumer.read(count, block_ms)
        if found:
            self.owner.returned.extend(found)
            self.owner.stop.set()
        return found
