"""Traces: OpenTelemetry spans along an instance's way, trigger → publish → claim → run →
record, joined across processes by the W3C ``traceparent`` carried in the stream envelope.

Off unless a role calls :func:`configure_tracing` with ``OTEL_EXPORTER_OTLP_ENDPOINT`` set (or
a test calls :func:`use`). While it is off, every call here is a check of one module variable
(a span is a shared null context), the SDK is not imported and no envelope carries a trace.
The tracer is this module's, not OpenTelemetry's global one, so a process (the tests,
``jobplane dev``) can turn tracing on and off.
"""

from __future__ import annotations

import logging
import os
import threading
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

from opentelemetry import propagate
from opentelemetry.context import Context
from opentelemetry.trace import Span, Tracer, get_current_span, set_span_in_context

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

logger = logging.getLogger(__name__)

ENDPOINT_VARIABLE = "OTEL_EXPORTER_OTLP_ENDPOINT"
#: At exit, the spans still buffered get this long to go out; a collector that does not answer
#: must not hold up a stopping role (a worker's grace period is counted on it).
FLUSH_TIMEOUT_S = 2.0
_tracer: Tracer | None = None
_NOTHING: AbstractContextManager[None] = nullcontext()


def configure_tracing(service: str) -> TracerProvider | None:
    """Export spans over OTLP (HTTP) when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set; the
    exporter reads the other ``OTEL_EXPORTER_OTLP_*`` variables itself. Returns the provider
    (the caller passes it to :func:`shutdown_tracing` at exit), or ``None``: off."""
    if not os.environ.get(ENDPOINT_VARIABLE):
        return None
    # Imported only when tracing is on: a process that does not trace never loads the SDK.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # No exit hook of the SDK's own (it would wait up to 30 s): see shutdown_tracing.
    provider = TracerProvider(
        resource=Resource.create({"service.name": service}), shutdown_on_exit=False
    )
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    use(provider)
    logger.info(
        "exporting traces to %s",
        os.environ[ENDPOINT_VARIABLE],
        extra={"action": "telemetry.tracing"},
    )
    return provider


def shutdown_tracing(provider: TracerProvider, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
    """Stop tracing and send what is buffered, waiting at most ``timeout_s``: past it, the
    rest is dropped (the SDK's threads are daemons and end with the process)."""
    use(None)
    closing = threading.Thread(target=provider.shutdown, name="jobplane-trace-flush", daemon=True)
    closing.start()
    closing.join(timeout_s)
    if closing.is_alive():
        logger.warning(
            "traces not all sent within %.0f s; the rest are dropped",
            timeout_s,
            extra={"action": "telemetry.flush_timeout"},
        )


def use(provider: TracerProvider | None) -> None:
    """Trace with ``provider`` from now on (``None``: stop tracing)."""
    global _tracer
    _tracer = provider.get_tracer("jobplane") if provider is not None else None


def tracer() -> Tracer | None:
    """The tracer, or ``None`` while tracing is off (callers then skip their spans)."""
    return _tracer


def span(
    name: str, parent: Context | None = None, **attributes: str | int
) -> AbstractContextManager[object]:
    """A span around the block, child of the current one (or of ``parent``); when tracing
    is off, a shared do-nothing context."""
    if _tracer is None:
        return _NOTHING
    return _tracer.start_as_current_span(name, context=parent, attributes=attributes)


def traceparent() -> str | None:
    """The current span's W3C ``traceparent``, to carry in an envelope; ``None`` when off."""
    if _tracer is None:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent")


def context_of(traceparent: str | None) -> Context | None:
    """The context an envelope's ``traceparent`` names (``None``: none carried, or off)."""
    if _tracer is None or traceparent is None:
        return None
    return propagate.extract({"traceparent": traceparent})


def context_with(span: Span) -> Context:
    return set_span_in_context(span)


def current_trace_id() -> str | None:
    """The trace id (32 hex digits) of the current span, for log lines; ``None`` when off or
    outside any span."""
    if _tracer is None:
        return None
    context = get_current_span().get_span_context()
    return f"{context.trace_id:032x}" if context.is_valid else None
