"""Prometheus metrics of the api role, computed from the store at scrape time: one statement
per scrape at most, and none while the last answer is younger than ``ttl_s`` (several
Prometheus servers, or a scrape storm, cost the database nothing more)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

from jobplane.store.sql import SqlStore


class MetricsCache:
    """The last rendered scrape, reused for ``ttl_s`` seconds; one refresh at a time."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._body = b""
        self._until = -1.0
        self._lock = asyncio.Lock()

    async def render(self, store: SqlStore) -> tuple[bytes, str]:
        async with self._lock:
            if self.clock() >= self._until:
                self._body = await render_metrics(store)
                self._until = self.clock() + self.ttl_s
            return self._body, CONTENT_TYPE_LATEST


async def render_metrics(store: SqlStore) -> bytes:
    """A fresh registry per scrape: the figures are the store's, not this process's."""
    counts, live_workers = await store.gauges()
    registry = CollectorRegistry()
    instances = Gauge(
        "jobplane_instances",
        "Instances by job and state",
        ["job", "state"],
        registry=registry,
    )
    for (job, state), count in sorted(counts.items()):
        instances.labels(job=job, state=state.value).set(count)
    workers = Gauge(
        "jobplane_workers", "Registered workers that have not stopped", registry=registry
    )
    workers.set(live_workers)
    return generate_latest(registry)
