"""Stopping asyncio tasks for certain."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
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
                "task %s survived its cancellation; cancelling it again",
                task.get_name(),
                extra={"action": "tasks.recancel"},
            )
            task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
