"""Stopping asyncio tasks for certain."""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import Collection, Coroutine
from typing import Any

logger = logging.getLogger(__name__)

#: How long a cancelled task may take to end before it is cancelled again.
RECANCEL_AFTER_S = 2.0


async def cancel_and_wait(tasks: Collection[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and wait until every one has ended; their exceptions are dropped.

    A cancellation can be lost inside a library: a read whose own timeout expires together
    with the cancel may turn it into an ordinary timeout, and the retry loop around the read
    goes on. A task still running ``RECANCEL_AFTER_S`` after its cancel is cancelled again
    (and logged), so a stopping role never waits on it forever.
    """
    pending = {task for task in tasks if not task.done()}
    for task in pending:
        task.cancel()
    while pending:
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_AFTER_S)
        for task in pending:
            logger.warning(
                "task %s survived its cancellation; cancelling it again; it waits at:\n%s",
                task.get_name(),
                _where(task),
                extra={"action": "tasks.recancel"},
            )
            task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _where(task: asyncio.Task[Any]) -> str:
    """Where ``task`` is suspended (its innermost frames), for the log."""
    stack = io.StringIO()
    task.print_stack(limit=8, file=stack)
    return stack.getvalue()


async def run_together(*coros: Coroutine[Any, Any, None]) -> None:
    """Run ``coros`` as tasks until one fails or this task is cancelled; then stop the others
    with :func:`cancel_and_wait`. As ``asyncio.TaskGroup``, but a child that swallows its
    cancellation is cancelled again instead of keeping the group (and its role) waiting for
    ever, and a cancel of this task always ends in ``CancelledError``, never in a group of
    the errors its children raised while being cancelled.

    Raises an exception group of the children's errors when one failed.
    """
    tasks = [asyncio.create_task(coro, name=getattr(coro, "__qualname__", None)) for coro in coros]
    cancelled = False
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except asyncio.CancelledError:
        cancelled = True
    while True:
        try:
            await cancel_and_wait(tasks)
            break
        except asyncio.CancelledError:
            cancelled = True  # cancelled again while stopping them: finish stopping them
    if cancelled:
        raise asyncio.CancelledError
    errors = [error for task in tasks if not task.cancelled() and (error := task.exception())]
    if errors:
        raise BaseExceptionGroup("tasks failed", errors)


def being_cancelled() -> bool:
    """Whether the current task has a cancellation pending or in flight. A driver may turn a
    cancel that reaches it mid-I/O into a connection error; the layers that translate such
    errors into "unavailable" ask this first, so a cancel stays a cancel (a retry loop would
    otherwise take it for an outage and go on)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
