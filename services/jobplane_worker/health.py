"""The worker's probe server (``--health-port``): ``/healthz``, ``/readyz``, ``/metrics``.

A tiny Starlette app served by uvicorn on the worker's own event loop, so an answer from
``/healthz`` proves that loop is alive. ``/readyz`` answers 503 when this worker cannot usefully
take work: Postgres or Redis does not answer within :data:`jobplane.probes.CHECK_TIMEOUT_S`,
every job slot (``--concurrency``, the sync-job pool's threads) is held by a runaway (a job
past its timeout that ignores its cancellation), or the worker is starting or shutting down.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Protocol

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jobplane.bus.abc import Bus
from jobplane.probes import reach
from jobplane.serving import bind, serve_until
from jobplane.store.abc import WorkerStore
from jobplane_worker.metrics import WorkerMetrics
from jobplane_worker.settings import WorkerSettings

logger = logging.getLogger(__name__)

#: How long the probe server gets to finish its requests when the worker stops.
STOP_TIMEOUT_S = 5.0


class Probed(Protocol):
    """What the probes read of the worker."""

    @property
    def store(self) -> WorkerStore: ...
    @property
    def bus(self) -> Bus: ...
    @property
    def settings(self) -> WorkerSettings: ...
    @property
    def metrics(self) -> WorkerMetrics: ...
    @property
    def registered(self) -> bool: ...
    @property
    def stopping(self) -> bool: ...
    @property
    def runaway_count(self) -> int: ...


async def readiness(worker: Probed) -> tuple[bool, dict[str, dict[str, Any]]]:
    """Whether the worker is ready, and each check as ``{"ok": bool, "detail": str}``."""
    postgres, redis = await asyncio.gather(reach(worker.store.ping), reach(worker.bus.ping))
    threads = worker.settings.concurrency
    held = worker.runaway_count
    pool = {
        "ok": held < threads,
        "detail": f"{held} of {threads} job slot(s) held by runaway jobs that ignore their timeout",
    }
    if worker.stopping:
        state = {"ok": False, "detail": "shutting down"}
    elif not worker.registered:
        state = {"ok": False, "detail": "starting"}
    else:
        state = {"ok": True, "detail": "consuming"}
    checks = {"postgres": postgres, "redis": redis, "job_pool": pool, "worker": state}
    return all(c["ok"] for c in checks.values()), checks


def health_app(worker: Probed) -> Starlette:
    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        ready, checks = await readiness(worker)
        body = {"status": "ready" if ready else "not ready", "checks": checks}
        return JSONResponse(body, status_code=200 if ready else 503)

    async def metrics(request: Request) -> Response:
        body, content_type = worker.metrics.render()
        return Response(body, media_type=content_type)

    return Starlette(
        routes=[
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ]
    )


@asynccontextmanager
async def serving(worker: Probed, host: str, port: int) -> AsyncIterator[asyncio.Task[None]]:
    """Serve the probes while the block runs; yields the serving task (if it ends early,
    the probe server died and the worker should stop). The port is bound before the block
    starts, so a port in use fails the worker at once."""
    sock = bind(host, port)
    stop = asyncio.Event()
    config = uvicorn.Config(
        health_app(worker),
        log_config=None,  # the worker's logging stays as the CLI set it up
        access_log=False,
        lifespan="off",
        log_level=worker.settings.log_level.lower(),
    )
    task = asyncio.create_task(serve_until(config, stop, [sock]), name="jobplane-health")
    logger.info(
        "health, readiness and metrics on http://%s:%d",
        host,
        port,
        extra={"action": "worker.health_serving"},
    )
    try:
        yield task
    finally:
        stop.set()
        await asyncio.wait({task}, timeout=STOP_TIMEOUT_S)
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        sock.close()
