"""The api application: ``create_app`` builds it, ``run_api`` serves it with uvicorn."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager

import uvicorn
from fastapi import FastAPI, HTTPException, Request
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jobplane import __version__
from jobplane.backends import backends
from jobplane.bus.abc import Bus
from jobplane.dispatch import Dispatcher
from jobplane.serving import bind, serve_until, supervise
from jobplane.startup import freeze_startup_heap
from jobplane.store.abc import ApiStore
from jobplane_api import dashboard, docs, problems
from jobplane_api.authn import AuthenticateFirst, Authenticator, SameSiteOnly
from jobplane_api.http_metrics import MULTIPROC_DIR, MeasureRequests, RequestMetrics
from jobplane_api.inputs import decimal
from jobplane_api.metrics import MetricsCache
from jobplane_api.protocol import ProblemHttpProtocol
from jobplane_api.routers import instances, jobs, system, tokens
from jobplane_api.security import document_roles
from jobplane_api.settings import ApiSettings

logger = logging.getLogger(__name__)

DESCRIPTION = """
Jobplane's REST API: job definitions, instances and their history, workers and the scheduler.

Errors are RFC 9457 `application/problem+json`; validation errors name the field at fault.

Authentication: every `/api/v1` route needs `Authorization: Bearer <token>` (use the
"Authorize" button). Roles: **viewer** reads, **operator** triggers, cancels, retries, pauses
and resumes, **admin** edits options and manages tokens. A request is authenticated before its
body is read: without a valid token the answer is 401 whatever the body; too many failed
authentications from one client in a minute get 429. `/healthz`, `/readyz` and `/metrics` are
open (they carry no job data), as are these docs.

Lists return instances without their arguments, result, checkpoint and error: read one
instance for those.
"""


def create_app(
    settings: ApiSettings, *, store: ApiStore | None = None, bus: Bus | None = None
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
            # Closed before the store and bus (the stack's earlier entries): triggers' sends
            # still under way finish first.
            app.state.dispatcher = await stack.enter_async_context(
                Dispatcher(
                    app.state.store, app.state.bus, hold_triggered=settings.debug_hold_triggered
                )
            )
            app.state.settings = settings
            freeze_startup_heap()
            yield

    app = FastAPI(
        title="Jobplane",
        version=__version__,
        description=DESCRIPTION,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    problems.install(app)
    docs.install(app)

    # The last added runs first: headers on every answer, then authentication (before any
    # body is read), then the input guard.
    app.add_middleware(InputGuard, max_body_bytes=settings.max_body_bytes)
    app.state.metrics = MetricsCache(settings.metrics_cache_s)
    app.state.authenticator = Authenticator(
        failures_per_minute=settings.auth_failures_per_minute,
        negative_ttl_s=settings.auth_negative_cache_s,
    )
    if settings.auth_enabled:
        app.add_middleware(AuthenticateFirst, authenticator=app.state.authenticator)
    else:
        app.add_middleware(SameSiteOnly, served_on=settings.host)
    app.add_middleware(SecurityHeaders)
    # Added last, so outermost: it also counts what authentication and InputGuard refuse.
    app.state.request_metrics = RequestMetrics()
    app.add_middleware(MeasureRequests, metrics=app.state.request_metrics)

    routers = [module.router for module in (jobs, instances, system, tokens)]
    for router in routers:
        app.include_router(router)
    document_roles(app, routers)
    dashboard.mount(app)
    return app


class InputGuard:
    """Refuses input the API must never see, before any route runs (a plain ASGI middleware:
    no per-request task or body copy, unlike ``@app.middleware``).

    - A NUL (``%00``) in the path or query: 422. Postgres text cannot hold NUL; refusing it
      here keeps a bad request from becoming a 500 in the store.
    - A body over ``max_body_bytes``: 413, from ``Content-Length`` at once (a length that is
      not ASCII digits too), and for a chunked body (no length given) as soon as the bytes
      received pass the limit, so a client cannot stream around the limit.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
        if b"%00" in raw_path or b"%00" in scope["query_string"] or "\x00" in scope["path"]:
            await self._refuse(scope, receive, send, 422, "Invalid request", NUL_REFUSED)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None:
            # Anything but a short run of ASCII digits ("²", 5,000 nines) is refused as well.
            size = decimal(length, CONTENT_LENGTH_DIGITS)
            if size is None or size > self.max_body_bytes:
                await self._refuse(scope, receive, send, 413, *self._too_large())
                return
            await self.app(scope, receive, send)
            return
        await self.app(scope, self._bounded(receive), send)

    def _too_large(self) -> tuple[str, str]:
        return "Request body too large", f"the limit is {self.max_body_bytes} bytes"

    def _bounded(self, receive: Receive) -> Receive:
        received = 0

        async def bounded() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    # Raised inside the route's body read; the problem handler answers 413.
                    raise HTTPException(413, self._too_large()[1])
            return message

        return bounded

    @staticmethod
    async def _refuse(
        scope: Scope, receive: Receive, send: Send, status: int, title: str, detail: str
    ) -> None:
        response = problems.problem(status, title, detail, request=Request(scope))
        await response(scope, receive, send)


NUL_REFUSED = "NUL characters are not allowed"
#: A Content-Length with more digits is over any body limit (a 413, like one not a number).
CONTENT_LENGTH_DIGITS = 20

#: For HTML answers that set no policy of their own: nothing from elsewhere, no inline script.
DEFAULT_CSP = (
    "default-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; "
    "form-action 'self'"
)


class SecurityHeaders:
    """``X-Content-Type-Options: nosniff`` on every answer, and :data:`DEFAULT_CSP` on HTML
    answers that carry no ``Content-Security-Policy`` of their own."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers["X-Content-Type-Options"] = "nosniff"
                html = headers.get("content-type", "").startswith("text/html")
                if html and "content-security-policy" not in headers:
                    headers["Content-Security-Policy"] = DEFAULT_CSP
            await send(message)

        await self.app(scope, receive, send_with_headers)


async def run_api(
    settings: ApiSettings, stop: asyncio.Event, sockets: list[socket.socket] | None = None
) -> None:
    """Serve until ``stop`` is set, with a store and bus of its own. They are opened (and
    waited for) before uvicorn starts, so an unreachable backend is the role's one-line error
    rather than a failed lifespan inside uvicorn. ``sockets``: listen on these (bound by a
    supervisor, shared by its processes) instead of binding ``settings.host:port``, which is
    bound first, so that a port in use is a one-line error before anything starts (uvicorn
    bound it last and exited 3 with its own log lines)."""
    own = [] if sockets is not None else [bind(settings.host, settings.port)]
    try:
        async with backends(settings, stop) as (store, bus):
            await serve(settings, stop, store=store, bus=bus, sockets=sockets or own)
    finally:
        for sock in own:
            sock.close()


#: What each process of :func:`run_api_processes` runs: ``(settings, socket, index)``; it serves
#: the API on the socket (with :func:`run_api`) until SIGTERM. A module-level function, since
#: the process is spawned and the function is found again by its name.
ProcessMain = Callable[[ApiSettings, socket.socket, int], None]


def run_api_processes(settings: ApiSettings, process_main: ProcessMain) -> int:
    """Serve with ``settings.api_workers`` processes on one listening socket, bound here and
    inherited by each, each running ``process_main`` (the command's: logging, signals and the
    event loop are set up there); returns the exit code (see
    :func:`jobplane.serving.supervise`)."""
    sock = bind(settings.host, settings.port)
    try:
        logger.info(
            "serving on %s:%d with %d processes",
            settings.host,
            settings.port,
            settings.api_workers,
            extra={"action": "api.processes"},
        )
        args = [(settings, sock, n) for n in range(settings.api_workers)]
        with shared_request_metrics():
            return supervise(process_main, args, grace_s=PROCESS_STOP_TIMEOUT_S)
    finally:
        sock.close()


@contextmanager
def shared_request_metrics() -> Iterator[None]:
    """The processes' request figures, kept in files of a directory of their own (the
    Prometheus client's multiprocess mode, which they read at start from
    ``PROMETHEUS_MULTIPROC_DIR``) and summed by whichever process answers a scrape: each
    counted only its own, so a scrape saw one process's counters or the other's, going back
    and forth. Removed with the processes."""
    directory = tempfile.mkdtemp(prefix="jobplane-api-metrics-")
    previous = os.environ.get(MULTIPROC_DIR)
    os.environ[MULTIPROC_DIR] = directory  # (inherited by the processes spawned now)
    try:
        yield
    finally:
        if previous is None:
            del os.environ[MULTIPROC_DIR]
        else:
            os.environ[MULTIPROC_DIR] = previous
        shutil.rmtree(directory, ignore_errors=True)


#: How long the API processes get to finish their requests once told to stop.
PROCESS_STOP_TIMEOUT_S = 30.0


def trusted_proxies() -> str:
    """The addresses whose ``X-Forwarded-For`` and ``X-Forwarded-Proto`` the api believes
    (uvicorn's ``FORWARDED_ALLOW_IPS``: a comma-separated list, ``*`` for any): none unless
    set. uvicorn's own default believes 127.0.0.1, so any process on the api's host, or a
    proxy there that passes the client's own header on, could name the client address the
    failed-sign-in throttle counts: never throttled, or another address throttled at will."""
    return os.environ.get("FORWARDED_ALLOW_IPS", "").strip()


async def serve(
    settings: ApiSettings,
    stop: asyncio.Event,
    *,
    store: ApiStore | None = None,
    bus: Bus | None = None,
    sockets: list[socket.socket] | None = None,
) -> None:
    """Serve ``create_app(settings, store=…, bus=…)`` with uvicorn until ``stop`` is set."""
    trusted = trusted_proxies()
    config = uvicorn.Config(
        create_app(settings, store=store, bus=bus),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        log_config=None,  # uvicorn logs through the role's handler (text or JSON)
        lifespan="on",
        http=ProblemHttpProtocol,  # an unparsable request is answered with problem+json too
        proxy_headers=bool(trusted),
        forwarded_allow_ips=trusted or None,
    )
    await serve_until(config, stop, sockets)
