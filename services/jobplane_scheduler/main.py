"""Entry point of the scheduler role."""

from __future__ import annotations

import asyncio
import logging

from jobplane.backends import backends
from jobplane.serving import probe_server
from jobplane_scheduler.health import health_app
from jobplane_scheduler.scheduler import Scheduler
from jobplane_scheduler.settings import SchedulerSettings

logger = logging.getLogger(__name__)


async def run_scheduler(settings: SchedulerSettings, stop: asyncio.Event) -> None:
    """Run one scheduler replica until ``stop`` is set (it then releases the lease), with its
    probe server when ``settings.health_port`` is set."""
    async with backends(settings, stop) as (store, bus):
        scheduler = Scheduler(store, bus, settings)
        if not settings.health_port:
            await scheduler.run(stop)
            return
        host, port = settings.health_host, settings.health_port
        async with probe_server(health_app(scheduler), host, port, settings.log_level):
            logger.info(
                "health and readiness on http://%s:%d",
                host,
                port,
                extra={"action": "scheduler.health_serving"},
            )
            await scheduler.run(stop)
