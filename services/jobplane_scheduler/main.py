"""Entry point of the scheduler role."""

from __future__ import annotations

import asyncio

from jobplane.runtime import backends
from jobplane_scheduler.scheduler import Scheduler
from jobplane_scheduler.settings import SchedulerSettings


async def run_scheduler(settings: SchedulerSettings, stop: asyncio.Event) -> None:
    """Run one scheduler replica until ``stop`` is set (it then releases the lease)."""
    async with backends(settings, stop) as (store, bus):
        await Scheduler(store, bus, settings).run(stop)
