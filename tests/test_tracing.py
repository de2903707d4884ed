"""Traces: one trace per instance, trigger → publish → claim → run → record, across the
processes' boundary by the envelope (real Postgres and Redis; spans collected with the
OpenTelemetry SDK's in-memory exporter)."""

from __future__ import annotations

import json
import logging
import socket
import time
import uuid
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from jobplane import telemetry
from jobplane.app import App
from jobplane.bus.abc import Bus
from jobplane.bus.envelope import Envelope
from jobplane.dispatch import Dispatcher
from jobplane.logs import JsonFormatter
from jobplane.store.sql import SqlStore
from tests.scheduler_helpers import running_scheduler
from tests.store_helpers import define
from tests.worker_helpers import running_worker, settled, wait_for

app = App("traced")


@app.triggered()
async def traced() -> int:
    return 1


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry.use(provider)
    try:
        yield exporter
    finally:
        telemetry.use(None)
        provider.shutdown()


def _by_name(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    found: dict[str, ReadableSpan] = {}
    for span in exporter.get_finished_spans():
        assert span.name not in found, f"two {span.name} spans"
        found[span.name] = span
    return found


def _parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


async def test_a_triggered_instance_is_one_trace_from_trigger_to_record(
    pg_store: SqlStore, redis_bus: Bus, spans: InMemorySpanExporter
) -> None:
    async with running_worker(app, pg_store, redis_bus):
        instance = await Dispatcher(pg_store, redis_bus).trigger("traced")
        await settled(pg_store, [instance.id])

        async def recorded() -> bool:
            return any(s.name == "jobplane.record" for s in spans.get_finished_spans())

        await wait_for(recorded, timeout_s=5, what="the record span")
    found = _by_name(spans)
    assert set(found) == {
        "jobplane.trigger",
        "jobplane.publish",
        "jobplane.claim",
        "jobplane.run",
        "jobplane.record",
    }
    trace_ids = {s.context.trace_id for s in found.values()}
    assert len(trace_ids) == 1
    trigger, publish, claim = (
        found["jobplane.trigger"],
        found["jobplane.publish"],
        found["jobplane.claim"],
    )
    assert trigger.parent is None
    assert _parent_of(publish) == trigger.context.span_id
    assert _parent_of(claim) == publish.context.span_id  # carried by the stream entry
    assert _parent_of(found["jobplane.run"]) == claim.context.span_id
    assert _parent_of(found["jobplane.record"]) == claim.context.span_id
    assert claim.attributes is not None
    assert claim.attributes["jobplane.instance_id"] == str(instance.id)
    assert found["jobplane.record"].attributes == {"jobplane.state": "succeeded"}


async def test_a_cron_tick_starts_its_trace_at_the_fire(
    pg_store: SqlStore, redis_bus: Bus, spans: InMemorySpanExporter
) -> None:
    await define(pg_store, "tick", cron="* * * * * *")
    async with running_scheduler(pg_store, redis_bus):

        async def published() -> bool:
            return any(s.name == "jobplane.publish" for s in spans.get_finished_spans())

        await wait_for(published, timeout_s=5, what="a tick published")
    fire = next(s for s in spans.get_finished_spans() if s.name == "jobplane.trigger")
    publish = next(s for s in spans.get_finished_spans() if s.name == "jobplane.publish")
    assert fire.attributes is not None and fire.attributes["source"] == "cron"
    assert _parent_of(publish) == fire.context.span_id
    [delivery] = await redis_bus.consumer("w1", ["default"]).read(10, 100)
    assert delivery.envelope.trace is not None
    assert delivery.envelope.trace.split("-")[2] == f"{publish.context.span_id:016x}"


async def test_with_tracing_off_no_envelope_carries_a_trace(
    pg_store: SqlStore, redis_bus: Bus
) -> None:
    assert telemetry.tracer() is None
    await define(pg_store, "job")
    await Dispatcher(pg_store, redis_bus).trigger("job")
    [delivery] = await redis_bus.consumer("w1", ["default"]).read(10, 100)
    assert delivery.envelope.trace is None
    assert b'"tp"' not in delivery.envelope.encode()


def test_envelopes_without_a_trace_still_decode_and_a_bad_trace_is_dropped() -> None:
    instance_id = uuid.uuid4()
    old = b'{"v":1,"kind":"run","id":"%s","job":"j","prio":5}' % str(instance_id).encode()
    assert Envelope.decode(old) == Envelope(instance_id=instance_id, job_key="j", priority=5)
    traced = Envelope(instance_id, "j", 5, trace="00-" + "1" * 32 + "-" + "2" * 16 + "-01")
    assert Envelope.decode(traced.encode()) == traced
    bad = old.replace(b"}", b',"tp":7}')
    assert Envelope.decode(bad).trace is None


def test_tracing_stays_off_without_an_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(telemetry.ENDPOINT_VARIABLE, raising=False)
    assert telemetry.configure_tracing("jobplane-test") is None
    assert telemetry.tracer() is None and telemetry.traceparent() is None


def test_an_endpoint_turns_tracing_on_and_an_absent_collector_delays_exit_little(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A blackholed collector: connections are accepted and never answered.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    port = silent.getsockname()[1]
    monkeypatch.setenv(telemetry.ENDPOINT_VARIABLE, f"http://127.0.0.1:{port}")
    provider = telemetry.configure_tracing("jobplane-test")
    assert provider is not None and telemetry.tracer() is not None
    assert provider.resource.attributes["service.name"] == "jobplane-test"
    with telemetry.span("jobplane.trigger"):
        pass
    began = time.monotonic()
    try:
        telemetry.shutdown_tracing(provider, timeout_s=0.5)
    finally:
        silent.close()
    assert time.monotonic() - began < 1.5
    assert telemetry.tracer() is None
    flushes = [r for r in caplog.records if getattr(r, "action", "") == "telemetry.flush_timeout"]
    assert len(flushes) == 1


def test_json_log_lines_carry_the_trace_id_inside_a_span(spans: InMemorySpanExporter) -> None:
    formatter = JsonFormatter({"role": "worker"})
    record = logging.makeLogRecord({"msg": "hello", "levelname": "INFO"})
    assert "trace_id" not in json.loads(formatter.format(record))
    with telemetry.span("jobplane.run"):
        line = json.loads(formatter.format(record))
    [run] = spans.get_finished_spans()
    assert line["trace_id"] == f"{run.context.trace_id:032x}"
