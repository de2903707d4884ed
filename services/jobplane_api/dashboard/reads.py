"""A page's independent store reads, run at once where the store gains from it.

On Postgres each read takes a pooled connection of its own, so a page that needs ten of them
waits for the slowest instead of their sum. SQLite serialises every transaction on its file's
lock: reads started at once would only queue for it (each waiting in the busy handler's
backoff), so there they run one after the other, in the order they were started.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import ParamSpec, TypeVar

from jobplane.store.abc import StoreConnection

P = ParamSpec("P")
T = TypeVar("T")

#: At most this many reads of one page at once: a few viewers cannot take the api's whole
#: connection pool.
READS_AT_ONCE = 6


class PageReads:
    """Tasks for one page's reads; ``async with`` waits for all of them.

    :meth:`read` starts a store read (counted against the page's limit); :meth:`compose`
    starts work that itself awaits reads started here (not counted, or it could hold the
    only turn on SQLite while its own reads wait for it). Both take the function and its
    arguments, and call it only when the task runs (a task cancelled before it starts leaves
    no coroutine never awaited). If a task fails, the others are cancelled and the first
    failure is raised as itself, not as an exception group, so the api's error handlers (503
    while the store is unreachable) still apply.
    """

    def __init__(self, store: StoreConnection) -> None:
        self._turns = asyncio.Semaphore(READS_AT_ONCE if store.concurrent_reads else 1)
        self._group = asyncio.TaskGroup()

    async def __aenter__(self) -> PageReads:
        await self._group.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        failure: BaseException | None = None
        try:
            await self._group.__aexit__(exc_type, exc, tb)
        except BaseExceptionGroup as group:
            failure = _first(group)
        if failure is not None:
            raise failure  # outside the handler: its own cause and context stay

    def read(
        self, read: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs
    ) -> asyncio.Task[T]:
        return self._group.create_task(self._in_turn(read, *args, **kwargs))

    def compose(
        self, work: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs
    ) -> asyncio.Task[T]:
        return self._group.create_task(_call(work, *args, **kwargs))

    async def _in_turn(
        self, read: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        async with self._turns:
            return await read(*args, **kwargs)


async def _call(work: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> T:
    return await work(*args, **kwargs)


def _first(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first failure of ``group``, looking into nested groups."""
    first = group.exceptions[0]
    return _first(first) if isinstance(first, BaseExceptionGroup) else first
