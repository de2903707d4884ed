"""Run a Scheduler inside the test's event loop, on a clock the test can drive."""

from __future__ import annotations

import asyncio
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from typing import Any

from jobplane.bus.abc import Bus
from jobplane.clock import Clock
from jobplane.domain.models import InstanceSource, NewInstance
from jobplane.store.abc import LeaderStore, StoreConnection
from jobplane_scheduler.scheduler import Scheduler
from jobplane_scheduler.settings import SchedulerSettings
from tests.worker_helpers import wait_for

FAST = {
    "lease_ttl_s": 2.0,
    "sweep_interval_s": 0.2,
    "republish_after_s": 1.0,
    "reap_grace_s": 0.5,
}


class DrivenClock:
    """The store's clock plus an offset the test advances: time passes as usual, and
    :meth:`advance` moves it on at once, waking every sleeper whose time has then come.
    Only what the scheduler plans on its clock (cron ticks) runs ahead; what the database
    decides on its own clock (leases, promotions, creation times) does not.

    A sleep counts from its task's last reading of the clock (the reading its duration was
    computed from), so an advance between the two is not lost. Only the leader's cron loop
    sleeps on the clock: :meth:`passed` tells when it has acted on a given time."""

    def __init__(self, store: StoreConnection) -> None:
        self.store = store
        self.offset = timedelta()
        self._advanced = asyncio.Event()
        #: Per task: when (event loop time) it last read the clock, the offset then, the value.
        self._reads: weakref.WeakKeyDictionary[
            asyncio.Task[Any], tuple[float, timedelta, datetime]
        ] = weakref.WeakKeyDictionary()
        #: Per sleeping task: until when (on this clock) it sleeps, and what wakes it early.
        self._asleep: dict[asyncio.Task[Any], tuple[datetime, asyncio.Event | None]] = {}

    async def now(self) -> datetime:
        value = await self.store.now()
        offset = self.offset
        task = asyncio.current_task()
        if task is not None:
            self._reads[task] = (asyncio.get_running_loop().time(), offset, value + offset)
        return value + offset

    async def advance(self, seconds: float) -> datetime:
        """Move the clock on by ``seconds``; returns a time it has certainly reached."""
        before = await self.now()
        self.offset += timedelta(seconds=seconds)
        self._advanced.set()
        self._advanced = asyncio.Event()
        return before + timedelta(seconds=seconds)

    async def advance_to(self, at: datetime) -> datetime:
        """Advance to ``at`` (not back if it has passed); returns a time it has reached."""
        return await self.advance(max(0.0, (at - await self.now()).total_seconds()))

    async def passed(self, at: datetime) -> None:
        """Wait until the cron loop sleeps (not about to wake) until after ``at``: whatever
        was due by ``at`` has been fired by then (it sleeps until its next due tick at the
        latest, and a re-plan wakes it)."""

        async def asleep() -> bool:
            return any(
                until > at and (wake is None or not wake.is_set())
                for until, wake in self._asleep.values()
            )

        await wait_for(asleep, timeout_s=10, what=f"the cron loop to pass {at}")

    async def sleep(self, seconds: float, wake: asyncio.Event | None = None) -> float:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        read = self._reads.pop(task, None)
        if read is None:
            started, offset, until = loop.time(), self.offset, None
        else:
            started, offset, until = read[0], read[1], read[2] + timedelta(seconds=seconds)
        try:
            while wake is None or not wake.is_set():
                passed = loop.time() - started + (self.offset - offset).total_seconds()
                if passed >= seconds:
                    return passed - seconds
                if until is not None:
                    self._asleep[task] = (until, wake)
                waits = [asyncio.ensure_future(self._advanced.wait())]
                if wake is not None:
                    waits.append(asyncio.ensure_future(wake.wait()))
                try:
                    await asyncio.wait(
                        waits, timeout=seconds - passed, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    for waiting in waits:
                        waiting.cancel()
        finally:
            self._asleep.pop(task, None)
        return 0.0


@asynccontextmanager
async def running_scheduler(
    store: LeaderStore, bus: Bus, *, clock: Clock | None = None, **overrides: Any
) -> AsyncIterator[Scheduler]:
    settings = SchedulerSettings(
        **{"scheduler_id": f"s-{uuid.uuid4().hex[:8]}", **FAST, **overrides}
    )
    scheduler = Scheduler(store, bus, settings, clock)
    stop = asyncio.Event()
    task = asyncio.create_task(scheduler.run(stop))
    try:
        yield scheduler
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)


def sweeps(scheduler: Scheduler) -> int:
    """How many sweeps this replica has completed as leader."""
    name = "jobplane_scheduler_sweep_duration_seconds_count"
    return int(scheduler.metrics.registry.get_sample_value(name) or 0)


async def swept(scheduler: Scheduler, n: int = 3) -> None:
    """Wait until the leader has completed ``n`` more sweeps (the first may have begun
    before the call: ``n - 1`` whole sweeps ran after it)."""
    start = sweeps(scheduler)

    async def done() -> bool:
        return sweeps(scheduler) >= start + n

    await wait_for(done, timeout_s=10, what=f"{n} sweeps")


async def applied(scheduler: Scheduler, key: str, version: int = 1, paused: bool = False) -> None:
    """Wait until the leader has applied ``version`` of ``key``: cached and planned. The cache
    takes a version inside the re-plan, which holds the planning lock until the job's timer is
    planned and the cron loop woken: on the version alone, a test drove the clock on while the
    loop still slept on the old plan (a once-a-year cron edited to every second fired nothing
    in 22 driven seconds, then recorded its 22 ticks at once)."""

    async def done() -> bool:
        leader = scheduler._leader
        return (
            (scheduler.cached_definitions() or {}).get(key) == (version, paused)
            and leader is not None
            and not leader._planning.locked()
        )

    await wait_for(done, timeout_s=10, what=f"the leader to apply {key} v{version}")


async def advance_until(
    clock: DrivenClock,
    count: Callable[[], Awaitable[int]],
    n: int,
    *,
    what: str = "ticks",
) -> None:
    """Advance ``clock`` to the next whole second (the next tick of a one-second job) at a
    time until ``count()`` reaches ``n``. Each step waits for the cron loop to act on the time
    it reached, so the leader never falls behind the driven time (no tick is late because the
    test ran ahead) and a step never waits for a real second."""
    steps = n - await count() + 20
    for _ in range(steps):
        if await count() >= n:
            return
        now = await clock.now()
        reached = await clock.advance_to(
            now.replace(microsecond=0) + timedelta(seconds=1, milliseconds=1)
        )
        await clock.passed(reached)
    raise AssertionError(f"{what}: {await count()} of {n} after {steps} seconds driven")


async def fired_earlier(store: LeaderStore, keys: list[str], at: datetime) -> None:
    """Record the tick ``at`` of each of ``keys`` as an earlier leader would have fired it
    (its term then ended): the latest occurrence a new leader plans from."""
    lease = await store.acquire_leadership(0, "earlier", 30)
    assert lease is not None
    ticks = [NewInstance(job_key=k, source=InstanceSource.CRON, scheduled_at=at) for k in keys]
    await store.fire(lease, ticks)
    assert await store.release_leadership(0, "earlier", lease.term)
