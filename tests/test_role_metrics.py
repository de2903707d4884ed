"""Metrics of every role: the api's requests, the scheduler's leadership; docs/operations.md
lists exactly the metrics the roles expose."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jobplane.bus.abc import Bus
from jobplane.store.sql import SqlStore
from jobplane_api.http_metrics import RequestMetrics
from jobplane_api.main import create_app
from jobplane_api.metrics import render_metrics as api_store_metrics
from jobplane_api.settings import ApiSettings
from jobplane_scheduler.metrics import SchedulerMetrics
from jobplane_worker.metrics import WorkerMetrics
from tests.apps.basic import app as jobs_app
from tests.cli_helpers import ROOT, free_port, spawn_cli, stop_all, wait_http_ok


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples called ``name``, by their labels."""
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def exposed(text: str) -> dict[str, str]:
    """Metric name (as exposed: counters with ``_total``) → type; without the ``_created``
    timestamps the client library adds to counters and histograms."""
    return {
        (f.name + "_total" if f.type == "counter" else f.name): f.type
        for f in text_string_to_metric_families(text)
        if not f.name.endswith("_created")
    }


@pytest.fixture
async def api(pg_store: SqlStore, redis_bus: Bus) -> AsyncIterator[httpx.AsyncClient]:
    spec = jobs_app.jobs["echo"]
    await pg_store.register_definition(spec.options, spec.args_schema(), "test")
    settings = ApiSettings(auth_enabled=False, max_body_bytes=4096)
    app = create_app(settings, store=pg_store, bus=redis_bus)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            yield client


async def test_the_api_counts_and_times_requests_by_route_template(
    api: httpx.AsyncClient,
) -> None:
    for value in (1, 2):
        assert (
            await api.post("/api/v1/jobs/echo/instances", json={"args": {"value": value}})
        ).status_code == 201
    assert (await api.get("/api/v1/jobs/no-such-job")).status_code == 404
    assert (await api.get("/no/such/route")).status_code == 404
    assert (await api.post("/api/v1/jobs/echo/instances", content=b"x" * 5000)).status_code == 413
    text = (await api.get("/metrics")).text
    requests = samples(text, "jobplane_api_requests_total")
    route = "/api/v1/jobs/{key}/instances"
    assert requests[(("method", "POST"), ("route", route), ("status", "201"))] == 2
    assert requests[(("method", "GET"), ("route", "/api/v1/jobs/{key}"), ("status", "404"))] == 1
    assert requests[(("method", "GET"), ("route", "unmatched"), ("status", "404"))] == 1
    assert requests[(("method", "POST"), ("route", "unmatched"), ("status", "413"))] == 1
    counts = samples(text, "jobplane_api_request_duration_seconds_count")
    assert counts[(("method", "POST"), ("route", route))] == 2
    assert samples(text, "jobplane_instances")[(("job", "echo"), ("state", "enqueued"))] == 2
    # Both triggers wait in the default queue's middle band: unread, so all lag.
    band = (("band", "1"), ("queue", "default"))
    assert samples(text, "jobplane_stream_entries")[band] == 2
    assert samples(text, "jobplane_stream_lag")[band] == 2
    assert samples(text, "jobplane_stream_pending")[band] == 0
    assert samples(text, "jobplane_stream_lag")[(("band", "0"), ("queue", "default"))] == 0


async def test_only_the_leading_scheduler_says_it_leads(
    pg_database_url: str, redis_url: str, redis_prefix: str
) -> None:
    ports = [free_port(), free_port()]
    env = {
        "JOBPLANE_DATABASE_URL": pg_database_url,
        "JOBPLANE_REDIS_URL": redis_url,
        "JOBPLANE_KEY_PREFIX": redis_prefix,
        "JOBPLANE_HEALTH_HOST": "127.0.0.1",
    }
    procs = [spawn_cli("scheduler", "--health-port", str(port), **env) for port in ports]
    try:
        for port in ports:
            await asyncio.to_thread(wait_http_ok, f"http://127.0.0.1:{port}/healthz")
        async with httpx.AsyncClient() as client:
            deadline = time.monotonic() + 30
            while True:
                texts = [(await client.get(f"http://127.0.0.1:{p}/metrics")).text for p in ports]
                leading = [samples(t, "jobplane_scheduler_leader")[()] for t in texts]
                if sum(leading) == 1 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
        assert sorted(leading) == [0, 1]
        terms = [samples(t, "jobplane_scheduler_leader_term")[()] for t in texts]
        assert sorted(terms)[0] == 0 and sorted(terms)[1] >= 1
    finally:
        stop_all(procs, sig=signal.SIGTERM)


async def test_the_operations_doc_lists_exactly_what_the_roles_expose(
    pg_store: SqlStore, redis_bus: Bus
) -> None:
    body = await api_store_metrics(pg_store, redis_bus)
    requests = RequestMetrics()
    requests.requests.labels("GET", "/healthz", "200").inc()
    requests.duration.labels("GET", "/healthz").observe(0.001)
    worker = WorkerMetrics(16, lambda: 0, lambda: 0)
    texts = [
        body.decode(),
        requests.render().decode(),
        SchedulerMetrics(lambda: None).render()[0].decode(),
        worker.render()[0].decode(),
    ]
    actual: dict[str, str] = {}
    for text in texts:
        actual |= exposed(text)
    doc = (ROOT / "docs" / "operations.md").read_text()
    listed = dict(re.findall(r"^\| `(jobplane_\w+)` \| (\w+) \|", doc, flags=re.MULTILINE))
    assert listed == actual
