"""Prometheus metrics of the api role, computed from the store at scrape time."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

from jobplane.store.sql import SqlStore


async def render_metrics(store: SqlStore) -> tuple[bytes, str]:
    """A fresh registry per scrape: the figures are the store's, not this process's."""
    registry = CollectorRegistry()
    instances = Gauge(
        "jobplane_instances",
        "Instances by job and state",
        ["job", "state"],
        registry=registry,
    )
    for definition in await store.list_definitions():
        for state, count in (await store.count_by_state(definition.key)).items():
            instances.labels(job=definition.key, state=state.value).set(count)
    workers = Gauge(
        "jobplane_workers", "Registered workers that have not stopped", registry=registry
    )
    workers.set(sum(1 for w in await store.list_workers() if w.stopped_at is None))
    return generate_latest(registry), CONTENT_TYPE_LATEST
