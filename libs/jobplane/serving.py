"""Serve an ASGI app with uvicorn inside a role's own event loop, until the role stops."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from starlette.types import ASGIApp

from jobplane.errors import ConfigurationError

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """Signals are the caller's (the CLI sets ``stop``), not uvicorn's."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket; a port in use is a :class:`ConfigurationError` (one line at the
    command line), not an exit from inside uvicorn."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigurationError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.listen(128)
    sock.setblocking(False)
    return sock


async def serve_until(
    config: uvicorn.Config, stop: asyncio.Event, sockets: list[socket.socket] | None = None
) -> None:
    """Serve ``config.app`` until ``stop`` is set (or the server ends by itself), then let
    uvicorn finish the requests in flight."""
    server = _Server(config)
    serving = asyncio.create_task(server.serve(sockets=sockets))
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        server.should_exit = True
        await serving
    finally:
        stopping.cancel()
        if not serving.done():
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)


@asynccontextmanager
async def probe_server(app: ASGIApp, host: str, port: int, log_level: str) -> AsyncIterator[None]:
    """Serve ``app`` (a role's probes) on ``host:port`` while the block runs. The port is bound
    before the block starts, so a port in use fails the role at once; on exit the server gets
    :data:`PROBE_STOP_TIMEOUT_S` to finish its requests."""
    sock = bind(host, port)
    stop = asyncio.Event()
    config = uvicorn.Config(
        app,
        log_config=None,  # the role's logging stays as the CLI set it up
        access_log=False,
        lifespan="off",
        log_level=log_level.lower(),
    )
    task = asyncio.create_task(serve_until(config, stop, [sock]), name="jobplane-probes")
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait({task}, timeout=PROBE_STOP_TIMEOUT_S)
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        sock.close()


#: How long a probe server gets to finish its requests when its role stops.
PROBE_STOP_TIMEOUT_S = 5.0


def supervise(
    target: Callable[..., None], args: Sequence[tuple[Any, ...]], *, grace_s: float
) -> int:
    """Run ``target(*a)`` in a spawned process for each ``a`` in ``args`` until SIGTERM or
    SIGINT, or until one of them ends by itself (then the role is broken: it stops whole, and
    the orchestrator restarts it). Each process is then sent SIGTERM (its graceful stop),
    given ``grace_s`` in all, and killed if still running. Returns the exit code: 0 after a
    signal when every process stopped cleanly, else the first failure's (1 for a killed one)."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in STOP_SIGNALS}
    context = multiprocessing.get_context("spawn")
    parent = os.getpid()
    processes = [context.Process(target=_child, args=(target, parent, *a)) for a in args]
    #: The exit code of the process that ended by itself first (the others are then stopped).
    broke: int | None = None
    try:
        for process in processes:
            process.start()
        while not stop.wait(SUPERVISE_POLL_S):
            ended = [(i, p.exitcode) for i, p in enumerate(processes) if p.exitcode is not None]
            if ended:
                index, code = ended[0]
                broke = code
                logger.error(
                    "process %d ended by itself (exit code %s): stopping the others",
                    index,
                    code,
                    extra={"action": "supervisor.process_ended", "api_process": index},
                )
                break
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
        deadline = time.monotonic() + grace_s
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    codes = [p.exitcode for p in processes]
    # After a stop signal, a process that ended by the SIGTERM sent to it was still starting
    # (its own handler, which stops it gracefully, was not installed yet): nothing was lost.
    failed = [c for c in codes if c != 0 and not (stop.is_set() and c == -signal.SIGTERM)]
    if stop.is_set() and not failed:
        return 0
    if broke is not None and broke > 0:
        # Its own code: the others, stopped because of it, may have been killed by the stop
        # (that code, in the list's order, was the answer: 1 where the failure said 2).
        return broke
    first = failed[0] if failed else 1  # one ended cleanly by itself: still a broken role
    return first if first is not None and first > 0 else 1


def _child(target: Callable[..., None], parent: int, *args: Any) -> None:
    """A supervised process: ``target(*args)``, stopped as by SIGTERM (gracefully) once its
    supervisor is gone. Killed with SIGKILL, the supervisor left its processes serving the
    port, orphans that nothing would stop."""
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    target(*args)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)


#: How often a supervised process checks that its supervisor is still there.
PARENT_POLL_S = 0.5

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: How often :func:`supervise` checks that every process still runs.
SUPERVISE_POLL_S = 0.2
