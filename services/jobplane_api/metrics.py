"""Prometheus metrics of the api role, computed at scrape time from the store (three
statements: instance and live worker counts, the job definitions, the workers) and the bus
(one round trip: each queue stream's length, consumer-group lag and pending entries), and none
while the last answer is younger than ``ttl_s`` (several Prometheus servers, or a scrape
storm, cost nothing more).

These are cluster figures: every api replica reports the same ones (aggregate with ``max``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

from jobplane.bus.abc import Bus, StreamStats
from jobplane.errors import UnavailableError
from jobplane.store.abc import ApiStore

logger = logging.getLogger(__name__)


class MetricsCache:
    """The last rendered scrape, reused for ``ttl_s`` seconds; one refresh at a time."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._body = b""
        self._until = -1.0
        self._lock = asyncio.Lock()

    async def render(self, store: ApiStore, bus: Bus) -> tuple[bytes, str]:
        async with self._lock:
            if self.clock() >= self._until:
                self._body = await render_metrics(store, bus)
                self._until = self.clock() + self.ttl_s
            return self._body, CONTENT_TYPE_LATEST


async def render_metrics(store: ApiStore, bus: Bus) -> bytes:
    """A fresh registry per scrape: the figures are the store's and the bus's, not this
    process's. While the bus does not answer, the stream figures are left out."""
    counts, live_workers = await store.gauges()
    definitions, registered = await store.list_definitions(), await store.list_workers()
    try:
        streams = await bus.stream_stats(sorted({d.options.queue for d in definitions}))
    except UnavailableError as exc:
        logger.warning("stream figures left out: %s", exc, extra={"action": "api.metrics"})
        streams = []
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
    runners = Gauge(
        "jobplane_job_runners",
        "Live workers that registered the job and consume its queue (0: its instances wait)",
        ["job"],
        registry=registry,
    )
    for definition in definitions:
        runners.labels(job=definition.key).set(sum(w.runs(definition) for w in registered))
    _stream_gauges(registry, streams)
    return generate_latest(registry)


def _stream_gauges(registry: CollectorRegistry, streams: list[StreamStats]) -> None:
    labels = ["queue", "band"]
    length = Gauge(
        "jobplane_stream_entries",
        "Entries in a queue's band stream (unread, or delivered and not yet acknowledged)",
        labels,
        registry=registry,
    )
    lag = Gauge(
        "jobplane_stream_lag",
        "Entries of a queue's band stream never delivered to the workers' consumer group",
        labels,
        registry=registry,
    )
    pending = Gauge(
        "jobplane_stream_pending",
        "Entries of a queue's band stream delivered to a worker and not yet acknowledged",
        labels,
        registry=registry,
    )
    for stream in streams:
        values = (stream.queue, str(stream.band))
        length.labels(*values).set(stream.length)
        lag.labels(*values).set(stream.lag)
        pending.labels(*values).set(stream.pending)
