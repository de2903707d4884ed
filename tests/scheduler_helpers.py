"""Run a Scheduler inside the test's event loop."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from jobplane.bus.abc import Bus
from jobplane.store.sql import SqlStore
from jobplane_scheduler.scheduler import Scheduler
from jobplane_scheduler.settings import SchedulerSettings

FAST = {
    "lease_ttl_s": 2.0,
    "sweep_interval_s": 0.2,
    "republish_after_s": 1.0,
    "reap_grace_s": 0.5,
}


@asynccontextmanager
async def running_scheduler(
    store: SqlStore, bus: Bus, **overrides: Any
) -> AsyncIterator[Scheduler]:
    settings = SchedulerSettings(
        **{"scheduler_id": f"s-{uuid.uuid4().hex[:8]}", **FAST, **overrides}
    )
    scheduler = Scheduler(store, bus, settings)
    stop = asyncio.Event()
    task = asyncio.create_task(scheduler.run(stop))
    try:
        yield scheduler
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)
