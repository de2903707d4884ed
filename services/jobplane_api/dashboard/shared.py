"""A value every viewer of a page shares for a short time.

The Overview's lag percentiles read the last hour of history, and every open Overview polls
every few seconds. Shared, they are computed at most once per ``ttl_s`` per api process,
however many tabs are open, and requests that arrive while they are being computed wait for
that computation instead of starting their own."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Shared(Generic[T]):
    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._value: T | None = None
        self._at: float | None = None
        self._lock = asyncio.Lock()

    async def get(self, compute: Callable[[], Awaitable[T]]) -> T:
        """The value computed less than ``ttl_s`` ago, or a new one from ``compute``."""
        async with self._lock:
            if self._at is None or self._clock() - self._at >= self.ttl_s:
                self._value = await compute()
                self._at = self._clock()
            return self._value  # type: ignore[return-value]
