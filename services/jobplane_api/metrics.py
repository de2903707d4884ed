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
from collections.abc import Callable, Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

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
    process's. While the bus does not answer, the stream figures are left out. (Metric
    families, not gauges: the api's processes keep their gauges' values in shared files, see
    :data:`jobplane_api.http_metrics.MULTIPROC_DIR`, summed per process.)"""
    counts, live_workers = await store.gauges()
    definitions, registered = await store.list_definitions(), await store.list_workers()
    try:
        streams = await bus.stream_stats(sorted({d.options.queue for d in definitions}))
    except UnavailableError as exc:
        logger.warning("stream figures left out: %s", exc, extra={"action": "api.metrics"})
        streams = []
    instances = GaugeMetricFamily(
        "jobplane_instances", "Instances by job and state", labels=["job", "state"]
    )
    for (job, state), count in sorted(counts.items()):
        instances.add_metric([job, state.value], count)
    workers = GaugeMetricFamily(
        "jobplane_workers", "Registered workers that have not stopped", value=live_workers
    )
    runners = GaugeMetricFamily(
        "jobplane_job_runners",
        "Live workers that registered the job and consume its queue (0: its instances wait)",
        labels=["job"],
    )
    for definition in definitions:
        runners.add_metric([definition.key], sum(w.runs(definition) for w in registered))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Figures([instances, workers, runners, *_stream_families(streams)]))
    return generate_latest(registry)


class _Figures(Collector):
    """Figures computed once, served by one scrape."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


def _stream_families(streams: list[StreamStats]) -> list[Metric]:
    labels = ["queue", "band"]
    length = GaugeMetricFamily(
        "jobplane_stream_entries",
        "Entries in a queue's band stream (unread, or delivered and not yet acknowledged)",
        labels=labels,
    )
    lag = GaugeMetricFamily(
        "jobplane_stream_lag",
        "Entries of a queue's band stream never delivered to the workers' consumer group",
        labels=labels,
    )
    pending = GaugeMetricFamily(
        "jobplane_stream_pending",
        "Entries of a queue's band stream delivered to a worker and not yet acknowledged",
        labels=labels,
    )
    for stream in streams:
        values = [stream.queue, str(stream.band)]
        length.add_metric(values, stream.length)
        lag.add_metric(values, stream.lag)
        pending.add_metric(values, stream.pending)
    return [length, lag, pending]
