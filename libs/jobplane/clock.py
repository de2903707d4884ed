"""The time a role plans against, and its waits, as one object the role is given.

The leader's cron loop reads "now" and sleeps only through a :class:`Clock`, so a test can drive
time instead of waiting for it. Correctness never rests on it: leases, creation times and
promotions are decided in SQL against the database's own clock.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime
from typing import Protocol

from jobplane.store.abc import StoreConnection


class Clock(Protocol):
    """Where the scheduler reads the time it plans cron ticks against, and how it waits."""

    async def now(self) -> datetime:
        """The current time (aware UTC). Raises
        :class:`~jobplane.errors.StoreUnavailableError` when it is read from a store that
        does not answer (a database's clock; SQLite's is the process's, read without it)."""

    async def sleep(self, seconds: float, wake: asyncio.Event | None = None) -> float:
        """Return once ``seconds`` have passed on this clock (at once if not positive), or as
        soon as ``wake`` is set. Does not clear ``wake``. Returns how many seconds past the
        requested time it returned on this clock (0 when it returned before: woken)."""


class StoreClock:
    """The store's clock (the database's ``now()``), the one every process compares against;
    waits on the event loop's timer. Does not own the store."""

    def __init__(self, store: StoreConnection) -> None:
        self.store = store

    async def now(self) -> datetime:
        return await self.store.now()

    async def sleep(self, seconds: float, wake: asyncio.Event | None = None) -> float:
        # Late by what the event loop's clock says (the monotonic clock, which a SIGSTOP of
        # the process does not stop): the store's clock runs at the same rate.
        loop = asyncio.get_running_loop()
        until = loop.time() + max(0.0, seconds)
        if wake is None:
            await asyncio.sleep(max(0.0, seconds))
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), max(0.0, seconds))
        return max(0.0, loop.time() - until)
