"""SQLAlchemy's engine for asyncio, without its ORM.

``sqlalchemy.ext.asyncio`` imports SQLAlchemy's ORM along with its engine (the package's
``__init__`` loads ``AsyncSession``): 6 to 7 MB of each role's idle memory, for sessions no role
uses (docs/benchmarks.md, "Idle memory"). This module gives the store the part it does use: a
Core :class:`~sqlalchemy.engine.Engine` on an asyncio driver (asyncpg, aiosqlite), whose
calls run in a greenlet (:func:`sqlalchemy.util.greenlet_spawn`, as the extension runs
them), so that the driver's awaits reach the event loop. Results are buffered: the drivers'
cursors fetch every row before ``execute`` returns, so reading a result does no I/O.

The names and behaviour follow ``sqlalchemy.ext.asyncio`` for what the store calls; an
application's own ``AsyncEngine`` / ``AsyncSession`` are SQLAlchemy's (``enqueue_async``).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Coroutine, Generator, Mapping, Sequence
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, TypeVar, overload

from sqlalchemy import Dialect, create_engine
from sqlalchemy.engine import Connection, CursorResult, Engine, RootTransaction, ScalarResult
from sqlalchemy.engine.interfaces import CoreExecuteOptionsParameter
from sqlalchemy.exc import InvalidRequestError
from sqlalchemy.pool import Pool, PoolProxiedConnection
from sqlalchemy.sql.base import Executable
from sqlalchemy.sql.selectable import TypedReturnsRows
from sqlalchemy.util import greenlet_spawn
from sqlalchemy.util.typing import TupleAny, TypeVarTuple, Unpack

P = ParamSpec("P")
T = TypeVar("T")
Ts = TypeVarTuple("Ts")

Parameters = Mapping[str, Any] | Sequence[Mapping[str, Any]] | None


def create_async_engine(url: str, **kwargs: Any) -> AsyncEngine:
    """An engine for an asyncio driver's URL (``postgresql+asyncpg://``,
    ``sqlite+aiosqlite://``); ``kwargs`` are :func:`sqlalchemy.create_engine`'s."""
    engine = create_engine(url, **kwargs)
    if not engine.dialect.is_async:
        raise InvalidRequestError(f"{engine.dialect.driver} is not an asyncio driver")
    return AsyncEngine(engine)


class AsyncEngine:
    """A Core engine whose connections are used from asyncio (see the module)."""

    def __init__(self, sync_engine: Engine) -> None:
        self.sync_engine = sync_engine

    @property
    def dialect(self) -> Dialect:
        return self.sync_engine.dialect

    @property
    def pool(self) -> Pool:
        return self.sync_engine.pool

    def connect(self) -> AsyncConnection:
        """A connection, checked out of the pool when entered (``async with``)."""
        return AsyncConnection(self)

    @asynccontextmanager
    async def begin(self) -> AsyncIterator[AsyncConnection]:
        """A connection in a transaction: committed when the block ends, rolled back if it
        raises; the connection goes back to the pool either way."""
        async with self.connect() as conn, conn.begin():
            yield conn

    async def dispose(self, close: bool = True) -> None:
        """Close the pooled connections (``Engine.dispose``)."""
        await greenlet_spawn(self.sync_engine.dispose, close=close)

    async def raw_connection(self) -> PoolProxiedConnection:
        """A driver connection checked out of the pool; ``close()`` it (in a greenlet)."""
        return await greenlet_spawn(self.sync_engine.raw_connection)


class AsyncConnection:
    """One pooled connection, for ``async with`` (see :meth:`AsyncEngine.connect`)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._sync: Connection | None = None

    @property
    def sync_connection(self) -> Connection:
        if self._sync is None:
            raise RuntimeError("the connection is not started: use it in `async with`")
        return self._sync

    @property
    def dialect(self) -> Dialect:
        return self.engine.dialect

    @property
    def closed(self) -> bool:
        return self.sync_connection.closed

    async def start(self) -> AsyncConnection:
        """Check a connection out of the pool (``async with`` does it)."""
        if self._sync is not None:
            raise RuntimeError("the connection is already started")
        self._sync = await greenlet_spawn(self.engine.sync_engine.connect)
        return self

    def __await__(self) -> Generator[Any, None, AsyncConnection]:
        return self.start().__await__()

    async def __aenter__(self) -> AsyncConnection:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # The connection must go back to the pool even when the task is being cancelled: a
        # close abandoned half-way would leave it checked out (or return it to the pool
        # later, in the background, after the pool may have been disposed of).
        await run_to_completion(self.close())

    async def close(self) -> None:
        """Return the connection to the pool (rolling back a transaction left open)."""
        if self._sync is not None:
            await greenlet_spawn(self._sync.close)

    def begin(self) -> AsyncTransaction:
        """A transaction, for ``async with``: committed at the end of the block, rolled back
        if it raises."""
        return AsyncTransaction(self)

    async def commit(self) -> None:
        await greenlet_spawn(self.sync_connection.commit)

    async def rollback(self) -> None:
        await greenlet_spawn(self.sync_connection.rollback)

    async def invalidate(self, exception: BaseException | None = None) -> None:
        await greenlet_spawn(self.sync_connection.invalidate, exception)

    async def get_raw_connection(self) -> PoolProxiedConnection:
        """The pooled driver connection beneath this one (reconnecting an invalidated one)."""
        return await greenlet_spawn(getattr, self.sync_connection, "connection")

    async def execution_options(self, **options: Any) -> AsyncConnection:
        """Set options of this connection (``Connection.execution_options``)."""
        await greenlet_spawn(self.sync_connection.execution_options, **options)
        return self

    @overload
    async def execute(
        self,
        statement: TypedReturnsRows[Unpack[Ts]],
        parameters: Parameters = None,
        *,
        execution_options: CoreExecuteOptionsParameter | None = None,
    ) -> CursorResult[Unpack[Ts]]: ...

    @overload
    async def execute(
        self,
        statement: Executable,
        parameters: Parameters = None,
        *,
        execution_options: CoreExecuteOptionsParameter | None = None,
    ) -> CursorResult[Unpack[TupleAny]]: ...

    async def execute(
        self,
        statement: Executable,
        parameters: Parameters = None,
        *,
        execution_options: CoreExecuteOptionsParameter | None = None,
    ) -> CursorResult[Unpack[TupleAny]]:
        """Run ``statement``; its result is buffered."""
        return await _buffered(
            await greenlet_spawn(
                self.sync_connection.execute,
                statement,
                parameters,
                execution_options=execution_options,
            )
        )

    async def exec_driver_sql(
        self, statement: str, parameters: Parameters = None
    ) -> CursorResult[Any]:
        """Run a statement in the driver's own SQL (``Connection.exec_driver_sql``)."""
        return await _buffered(
            await greenlet_spawn(self.sync_connection.exec_driver_sql, statement, parameters)
        )

    async def scalar(self, statement: Executable, parameters: Parameters = None) -> Any:
        return (await self.execute(statement, parameters)).scalar()

    async def scalars(
        self, statement: Executable, parameters: Parameters = None
    ) -> ScalarResult[Any]:
        return (await self.execute(statement, parameters)).scalars()

    async def run_sync(
        self, fn: Callable[Concatenate[Connection, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """Call ``fn(sync_connection, *args, **kwargs)`` where it may use the connection as a
        blocking one (Alembic's migrations, the metadata's ``create_all``)."""
        return await greenlet_spawn(functools.partial(fn, self.sync_connection, *args, **kwargs))


class AsyncTransaction:
    """The connection's transaction, for ``async with`` (see :meth:`AsyncConnection.begin`)."""

    def __init__(self, connection: AsyncConnection) -> None:
        self.connection = connection
        self._sync: RootTransaction | None = None

    async def __aenter__(self) -> AsyncTransaction:
        self._sync = await greenlet_spawn(self.connection.sync_connection.begin)
        # Entered as the context of the block, as a ``with conn.begin():`` would: a statement
        # run after a commit or rollback inside the block then raises, where it would start
        # a transaction of its own that the block's end neither commits nor reports.
        self._sync.__enter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        assert self._sync is not None
        # Commits if the block ended normally, rolls back otherwise (``Transaction``'s own
        # context exit).
        await greenlet_spawn(self._sync.__exit__, exc_type, exc, traceback)


async def _buffered(result: CursorResult[Any]) -> CursorResult[Any]:
    """``result``, its cursor closed with its rows kept (the driver's close is awaitable on
    aiosqlite: it cannot run later, outside the greenlet). A server-side cursor would read
    its rows outside the greenlet: refused, as ``sqlalchemy.ext.asyncio`` refuses it."""
    if getattr(result.context, "_is_server_side", False):
        await greenlet_spawn(result.close)
        raise InvalidRequestError("stream_results is not supported by the store's engine")
    cursor = result.cursor
    if cursor is not None:
        await cursor._async_soft_close()
    return result


async def run_to_completion(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to its end even if the calling task is cancelled meanwhile; such a
    cancellation is raised once it has ended (as ``sqlalchemy.ext.asyncio`` closes its
    connections)."""
    task = asyncio.ensure_future(coro)
    cancelled: asyncio.CancelledError | None = None
    while True:
        try:
            result = await asyncio.shield(task)
        except asyncio.CancelledError as err:
            if task.done():
                raise
            cancelled = err
        else:
            break
    if cancelled is not None:
        raise cancelled
    return result
