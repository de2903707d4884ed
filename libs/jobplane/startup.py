"""Waiting for Postgres and Redis when a role starts.

Under compose or Kubernetes the roles often start before their backends answer (or while one
restarts). A role retries for ``JOBPLANE_STARTUP_TIMEOUT_S`` seconds, logging each failed try,
and only then gives up with the last error (one line at the command line, exit 2). Only
unavailability and a schema still behind this version (the migration may be running beside the
role, as a Kubernetes Job is) are retried: a bad setting, or a schema newer than this version, is
an answer, not a wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential

from jobplane.errors import SchemaBehindError, UnavailableError

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Backoff between tries: 0.5 s doubling, at most this long.
MAX_WAIT_S = 5.0


async def wait_until_reachable(
    check: Callable[[], Awaitable[T]],
    what: str,
    timeout_s: float,
    stop: asyncio.Event | None = None,
) -> T:
    """Run ``check`` until it raises neither :class:`UnavailableError` nor
    :class:`SchemaBehindError` (``jobplane migrate`` still to finish), retrying with backoff
    for at most ``timeout_s`` seconds (0: one try). No try starts after the deadline, and a
    set ``stop`` (SIGTERM while waiting) ends the wait at once; either way the last error is
    raised."""
    deadline = time.monotonic() + timeout_s

    def give_up(state: RetryCallState) -> bool:
        stopping = stop is not None and stop.is_set()
        return stopping or time.monotonic() + state.upcoming_sleep > deadline

    async def sleep(seconds: float) -> None:
        if stop is None:
            await asyncio.sleep(seconds)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), seconds)

    retrying = AsyncRetrying(
        retry=retry_if_exception_type((UnavailableError, SchemaBehindError)),
        wait=wait_exponential(multiplier=0.5, max=MAX_WAIT_S),
        stop=give_up,
        sleep=sleep,
        before_sleep=_log(what, deadline),
        reraise=True,
    )
    return await retrying(check)


def _log(what: str, deadline: float) -> Callable[[RetryCallState], None]:
    def log(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        logger.warning(
            "waiting for %s: %s; try %d failed, retrying in %.1f s (giving up in %.0f s)",
            what,
            error,
            state.attempt_number,
            state.upcoming_sleep,
            max(0.0, deadline - time.monotonic()),
            extra={"action": "startup.wait", "backend": what, "try": state.attempt_number},
        )

    return log


#: Whether :func:`freeze_startup_heap` freezes: set by a role's process (the ``jobplane``
#: command), never by a library user or a test that runs a role inside a process of its own.
_freeze_heap = False


def freeze_heap_at_startup() -> None:
    """Let :func:`freeze_startup_heap` freeze this process's heap: for a process that runs one
    role for its lifetime (the ``jobplane`` command)."""
    global _freeze_heap
    _freeze_heap = True


def freeze_startup_heap() -> None:
    """Once a role has started, move every object then alive (its modules, the app, the
    store's and the bus's machinery: most of the heap, and kept for the process's life) out
    of the garbage collector's reach (``gc.freeze``), so that a full collection walks only what
    the role allocates while it runs. In a worker at 300 triggers/s a full collection paused
    its event loop, and every job on it, for 61 to 67 ms; frozen, 1 to 2 ms (docs/benchmarks.md).
    Only in a process that asked for it (:func:`freeze_heap_at_startup`): frozen objects that
    later become cyclic garbage are never freed, which a long-lived role's start-up objects
    never do, but a test process that starts many roles would leak."""
    if _freeze_heap:
        # No collection first: it took 60 to 70 ms, with the worker's first claim waiting, and
        # found about 70 objects to free.
        gc.freeze()
