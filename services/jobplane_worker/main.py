"""Entry point of the worker role."""

from __future__ import annotations

import asyncio
import logging

from jobplane.app import load_app
from jobplane.backends import backends
from jobplane_worker.settings import WorkerSettings
from jobplane_worker.worker import Worker

logger = logging.getLogger(__name__)


async def run_worker(app_path: str, settings: WorkerSettings, stop: asyncio.Event) -> None:
    """Load the App at ``app_path`` and run one worker on it until ``stop`` is set, with a store
    and a bus of its own."""
    app = load_app(app_path)
    if settings.redis_url.startswith("memory://"):
        logger.warning(
            "JOBPLANE_REDIS_URL is not set: the in-process bus only carries jobs triggered "
            "in this process (use `jobplane dev` for that)",
            extra={"action": "worker.memory_bus"},
        )
    async with backends(settings, stop) as (store, bus):
        await Worker(app, store, bus, settings).run(stop)
