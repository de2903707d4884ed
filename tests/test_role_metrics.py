"""Metrics of every role: the api's requests, the scheduler's leadership; docs/operations.md
lists exactly the metrics the roles expose."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jobplane.bus.abc import Bus
from jobplane.dispatch import Dispatcher
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


async def test_the_api_counts_the_live_workers_that_can_run_each_job(
    api: httpx.AsyncClient, pg_store: SqlStore, redis_bus: Bus
) -> None:
    """``jobplane_job_runners``: 0 until a live worker of the job's queue registered it (one
    of another queue does not count); an alert pairs it with the job's Enqueued count."""
    from jobplane.domain.models import WorkerInfo

    def runners(text: str) -> float:
        return samples(text, "jobplane_job_runners")[(("job", "echo"),)]

    assert runners((await api.get("/metrics")).text) == 0
    for worker, queues in (("w-gpu", ("gpu",)), ("w-cpu", ("default",))):
        await pg_store.register_worker(WorkerInfo(worker, "h", 1, queues, 4, "1", ("echo",)))
    # Read afresh: the api's /metrics answers from its cache for a few seconds.
    assert runners((await api_store_metrics(pg_store, redis_bus)).decode()) == 1


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


async def role_metric_texts(store: SqlStore, bus: Bus) -> list[str]:
    """What every role exposes, from the roles' own code, with a sample in every labelled
    family (so that its label names show)."""
    spec = jobs_app.jobs["echo"]
    await store.register_definition(spec.options, spec.args_schema(), "test")
    await Dispatcher(store, bus).trigger("echo", {"value": 1})
    requests = RequestMetrics()
    requests.requests.labels("GET", "/healthz", "200").inc()
    requests.duration.labels("GET", "/healthz").observe(0.001)
    scheduler = SchedulerMetrics(lambda: None)
    scheduler.misfires.labels("skip", "skipped").inc()
    worker = WorkerMetrics(16, lambda: 0, lambda: 0)
    worker.claims.labels("echo").inc()
    worker.finished.labels("echo", "succeeded").inc()
    worker.runaways.labels("echo").inc()
    worker.lease_lost_writes.labels("heartbeat").inc()
    return [
        (await api_store_metrics(store, bus)).decode(),
        requests.render().decode(),
        scheduler.render()[0].decode(),
        worker.render()[0].decode(),
    ]


async def every_role_metric(store: SqlStore, bus: Bus) -> dict[str, str]:
    """Every metric the roles expose: name as exposed → type."""
    actual: dict[str, str] = {}
    for text in await role_metric_texts(store, bus):
        actual |= exposed(text)
    return actual


async def test_the_operations_doc_lists_exactly_what_the_roles_expose(
    pg_store: SqlStore, redis_bus: Bus
) -> None:
    texts = await role_metric_texts(pg_store, redis_bus)
    actual: dict[str, str] = {}
    for text in texts:
        actual |= exposed(text)
    doc = (ROOT / "docs" / "operations.md").read_text()
    rows = dict(re.findall(r"^\| `(jobplane_\w+)` \| (\w+ \|.*)$", doc, flags=re.MULTILINE))
    assert {name: row.split(" |")[0] for name, row in rows.items()} == actual
    # Each row names its metric's labels.
    for text in texts:
        for family in text_string_to_metric_families(text):
            name = family.name + "_total" if family.type == "counter" else family.name
            labels = {label for s in family.samples for label in s.labels} - {"le"}
            if name in rows:
                assert all(f"`{label}`" in rows[name] for label in labels), (name, labels)


def dashboard_queries() -> list[str]:
    dashboard = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
    return [target["expr"] for panel in panels for target in panel["targets"]]


async def test_the_grafana_dashboard_queries_only_metrics_that_exist(
    pg_store: SqlStore, redis_bus: Bus
) -> None:
    actual = await every_role_metric(pg_store, redis_bus)
    series = {
        name + suffix
        for name, kind in actual.items()
        for suffix in (("_bucket", "_sum", "_count") if kind == "histogram" else ("",))
    }
    used = {name for expr in dashboard_queries() for name in re.findall(r"jobplane_\w+", expr)}
    assert used <= series, used - series
    # And every metric has a panel.
    assert {name for name in actual if not any(s.startswith(name) for s in used)} == set()
