"""The api application: ``create_app`` builds it, ``run_api`` serves it with uvicorn."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request, Response

from jobplane import __version__
from jobplane.bus.abc import Bus
from jobplane.dispatch import Dispatcher
from jobplane.runtime import backends
from jobplane.serving import serve_until
from jobplane.store.sql import SqlStore
from jobplane_api import problems
from jobplane_api.routers import instances, jobs, system, tokens
from jobplane_api.settings import ApiSettings

logger = logging.getLogger(__name__)

DESCRIPTION = """
Jobplane's REST API: job definitions, instances and their history, workers and the scheduler.

Errors are RFC 9457 `application/problem+json`; validation errors name the field at fault.
"""


def create_app(
    settings: ApiSettings, *, store: SqlStore | None = None, bus: Bus | None = None
) -> FastAPI:
    """The FastAPI app. A ``store``/``bus`` handed in is used and not closed; otherwise the
    lifespan opens them from ``settings`` and closes them on shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            if store is None or bus is None:
                opened_store, opened_bus = await stack.enter_async_context(backends(settings))
            app.state.store = store or opened_store
            app.state.bus = bus or opened_bus
            app.state.dispatcher = Dispatcher(app.state.store, app.state.bus)
            app.state.settings = settings
            yield

    app = FastAPI(
        title="Jobplane",
        version=__version__,
        description=DESCRIPTION,
        lifespan=lifespan,
    )
    problems.install(app)

    @app.middleware("http")
    async def guard_input(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        if "%00" in request.url.path or "%00" in request.url.query:
            # Postgres text cannot hold NUL: refuse it here rather than fail in the store.
            return problems.problem(
                422, "Invalid request", "NUL characters are not allowed", request=request
            )
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > settings.max_body_bytes):
            return problems.problem(
                413,
                "Request body too large",
                f"the limit is {settings.max_body_bytes} bytes",
                request=request,
            )
        return await call_next(request)

    for module in (jobs, instances, system, tokens):
        app.include_router(module.router)
    return app


async def run_api(settings: ApiSettings, stop: asyncio.Event) -> None:
    """Serve until ``stop`` is set, with a store and bus of its own."""
    await serve(settings, stop)


async def serve(
    settings: ApiSettings,
    stop: asyncio.Event,
    *,
    store: SqlStore | None = None,
    bus: Bus | None = None,
) -> None:
    """Serve ``create_app(settings, store=…, bus=…)`` with uvicorn until ``stop`` is set."""
    config = uvicorn.Config(
        create_app(settings, store=store, bus=bus),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        lifespan="on",
    )
    await serve_until(config, stop)
