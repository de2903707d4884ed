"""Request count and latency of the api, by method, route template and status.

A plain ASGI middleware (no per-request task, no body copy). The route is the matched
template (``/api/v1/jobs/{key}``), never the raw path, so label values stay few; a request that
matched no route (a 404, or one refused before routing) is ``unmatched``.
"""

from __future__ import annotations

import os
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

UNMATCHED = "unmatched"
#: Latency buckets (seconds): a trigger costs about a millisecond, a listing tens.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


#: Set by ``jobplane api --workers N`` for its processes: the Prometheus client keeps every
#: process's figures in files there (read when it is imported), and a scrape sums them.
MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"


class RequestMetrics:
    """The api process's request figures, in a registry of its own; with several processes,
    rendered as the sum of all of theirs."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "jobplane_api_requests",
            "HTTP requests answered, by method, route template and status",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "jobplane_api_request_duration_seconds",
            "Time to answer an HTTP request, by method and route template",
            ["method", "route"],
            buckets=BUCKETS,
            registry=self.registry,
        )

    def render(self) -> bytes:
        if os.environ.get(MULTIPROC_DIR):
            from prometheus_client.multiprocess import MultiProcessCollector

            summed = CollectorRegistry()
            MultiProcessCollector(summed)  # type: ignore[no-untyped-call]
            return generate_latest(summed)
        return generate_latest(self.registry)


class MeasureRequests:
    """Counts and times every HTTP request, including those refused before routing."""

    def __init__(self, app: ASGIApp, metrics: RequestMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        began = time.perf_counter()
        status = 500  # the app raised before it answered

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            # The router records the matched route in the (shared) scope.
            route = getattr(scope.get("route"), "path", None) or UNMATCHED
            method = scope["method"]
            self.metrics.requests.labels(method, route, str(status)).inc()
            self.metrics.duration.labels(method, route).observe(time.perf_counter() - began)
