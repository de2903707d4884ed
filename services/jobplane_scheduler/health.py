"""The scheduler's probe server (``--health-port``): ``/healthz``, ``/readyz``, ``/metrics`` and
``/definitions``.

Readiness never depends on leading: a follower is as ready as the leader (it stands by to
take over), so an orchestrator keeps both replicas. ``/readyz`` answers 503 only while
Postgres or Redis does not answer within :data:`jobplane.probes.CHECK_TIMEOUT_S`; it reports
whether this replica leads, for people. ``/definitions`` shows the leader's definition cache
(job key → version and paused), so an operator can see that an edit has reached it; a
follower caches nothing and shows ``null``.
"""

from __future__ import annotations

import asyncio

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jobplane.probes import reach
from jobplane_scheduler.scheduler import Scheduler


def health_app(scheduler: Scheduler) -> Starlette:
    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        postgres, redis = await asyncio.gather(
            reach(scheduler.store.ping), reach(scheduler.bus.ping)
        )
        ready = bool(postgres["ok"] and redis["ok"])
        body = {
            "status": "ready" if ready else "not ready",
            "leader": scheduler.lease is not None,
            "checks": {"postgres": postgres, "redis": redis},
        }
        return JSONResponse(body, status_code=200 if ready else 503)

    async def definitions(request: Request) -> Response:
        cached = scheduler.cached_definitions()
        jobs = (
            None
            if cached is None
            else {k: {"version": v, "paused": p} for k, (v, p) in sorted(cached.items())}
        )
        return JSONResponse({"leader": cached is not None, "definitions": jobs})

    async def metrics(request: Request) -> Response:
        body, content_type = render_metrics(scheduler)
        return Response(body, media_type=content_type)

    return Starlette(
        routes=[
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/definitions", definitions, methods=["GET"]),
        ]
    )


def render_metrics(scheduler: Scheduler) -> tuple[bytes, str]:
    """The replica's figures: leadership, ticks, sweeps (see :mod:`.metrics`)."""
    return scheduler.metrics.render()
