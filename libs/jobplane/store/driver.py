"""A hot statement run on the asyncpg connection beneath SQLAlchemy's pooled connection.

SQLAlchemy's per-call execution machinery (execution context, cursor adapter, result
metadata, the greenlet hop) cost the single trigger three times the CPU of asyncpg's own
execution of the same statement (docs/benchmarks.md, "Trigger path"). A
:class:`DriverStatement` skips it for one statement: the connection still comes from the
engine's pool (checkout listeners, reset on return), asyncpg keeps the statement prepared in
its statement cache, results get the column types' own conversions, and errors are reported
exactly as SQLAlchemy reports those of its own executions (the same ``DBAPIError``, a broken
connection invalidated), so callers and the store's error handling see no difference.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import Dialect
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import PoolProxiedConnection
from sqlalchemy.sql.elements import TextClause
from sqlalchemy.sql.selectable import TextualSelect
from sqlalchemy.util import greenlet_spawn

from jobplane.store.engine import AsyncConnection, AsyncEngine


class DriverStatement:
    """A ``text()`` statement (with ``.columns(...)``), compiled once for ``dialect`` (asyncpg),
    run on the driver connection beneath a SQLAlchemy connection (:meth:`fetch`), or beneath a
    connection it checks out of the pool for itself (:meth:`run`, :meth:`run_row`).

    The statement runs in the connection's current state: on a connection that has executed
    nothing through SQLAlchemy (so none of its ``BEGIN``), it is a transaction of its own, as
    in autocommit. Only for single-statement writes and reads that need no transaction."""

    def __init__(self, statement: TextClause | TextualSelect, dialect: Dialect) -> None:
        compiled = statement.compile(dialect=dialect)
        self.sql = compiled.string
        #: The bound parameters' names, in the order of ``$1``, ``$2``, …
        self.names = tuple(compiled.positiontup or ())
        self._types = (
            {c.key: c.type for c in statement.selected_columns}
            if isinstance(statement, TextualSelect)
            else {}
        )
        self._dialect = dialect
        #: Result conversions by column (the types' own), set from the first prepare: some
        #: depend on the type the server reports.
        self._processors: list[tuple[str, Callable[[Any], Any]]] | None = None

    async def fetch(self, conn: AsyncConnection, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Every row of the statement, by column name."""
        raw = await conn.get_raw_connection()
        args = [params[name] for name in self.names]
        try:
            records = await self._execute(raw.driver_connection, args)
        except BaseException as exc:
            # SQLAlchemy's own error handling (it may close the connection: in a greenlet).
            sync_conn, dbapi_conn = conn.sync_connection, raw.dbapi_connection
            await greenlet_spawn(_raise_as_sqlalchemy, sync_conn, dbapi_conn, exc, self.sql, args)
            raise  # (not reached: the handler always raises)
        return self._rows(records)

    async def run_row(self, engine: AsyncEngine, params: Mapping[str, Any]) -> dict[str, Any]:
        """The statement's first row (it must return one), by column name (see :meth:`run`)."""
        found = await self.run(engine, params)
        if not found:
            raise LookupError("the statement returned no row")
        return found[0]

    async def run(self, engine: AsyncEngine, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        """As :meth:`fetch`, on a connection checked out of ``engine``'s pool for this one
        statement and returned right after. It is checked out bare, without the SQLAlchemy
        ``Connection`` that ``engine.connect()`` wraps around it (22 µs of CPU a checkout
        instead of 45, a tenth of a single trigger's CPU in the caller); the pool's own
        events and reset on return are the same. An error builds that ``Connection`` around
        the pooled one then, so that it is reported and the connection invalidated exactly
        as :meth:`fetch` does."""
        pooled = await greenlet_spawn(_checkout, engine.sync_engine)
        try:
            args = [params[name] for name in self.names]
            try:
                records = await self._execute(pooled.driver_connection, args)
            except BaseException as exc:
                await greenlet_spawn(
                    _raise_pooled_as_sqlalchemy, engine.sync_engine, pooled, exc, self.sql, args
                )
                raise  # (not reached: the handler always raises)
        finally:
            await greenlet_spawn(pooled.close)  # back to the pool (closed, if invalidated)
        return self._rows(records)

    async def _execute(self, driver: Any, args: list[Any]) -> Any:
        if self._processors is None:
            self._processors = self._result_processors(await driver.prepare(self.sql))
        return await driver.fetch(self.sql, *args)

    def _rows(self, records: Any) -> list[dict[str, Any]]:
        processors = self._processors or []
        found = []
        for record in records:
            row = dict(record.items())
            for key, process in processors:
                value = row[key]
                if value is not None:  # (every type's conversion keeps a NULL a None)
                    row[key] = process(value)
            found.append(row)
        return found

    def _result_processors(self, prepared: Any) -> list[tuple[str, Callable[[Any], Any]]]:
        found: list[tuple[str, Callable[[Any], Any]]] = []
        for attribute in prepared.get_attributes():
            column_type = self._types.get(attribute.name)
            if column_type is None:
                continue
            process = column_type._cached_result_processor(self._dialect, attribute.type.oid)
            if process is not None:
                found.append((attribute.name, process))
        return found


def _checkout(engine: Engine) -> PoolProxiedConnection:
    """A connection from ``engine``'s pool, bare; a connection the server refuses is reported
    as ``engine.connect()`` reports it (a ``DBAPIError``; invalidating the pool if it means
    the server is gone)."""
    try:
        return engine.raw_connection()
    except engine.dialect.loaded_dbapi.Error as exc:
        Connection._handle_dbapi_exception_noconnection(exc, engine.dialect, engine)
        raise


def _raise_pooled_as_sqlalchemy(
    engine: Engine,
    pooled: PoolProxiedConnection,
    exc: BaseException,
    statement: str,
    args: list[Any],
) -> None:
    """:func:`_raise_as_sqlalchemy` for a connection checked out bare: the ``Connection`` that
    reports the error is built around the pooled one (the same one ``engine.connect()`` would
    have wrapped), so that an error that means it is broken invalidates it."""
    conn = Connection(engine, connection=pooled)
    _raise_as_sqlalchemy(conn, pooled.dbapi_connection, exc, statement, args)


def _raise_as_sqlalchemy(
    sync_conn: Connection | None,
    dbapi_conn: Any,
    exc: BaseException,
    statement: str,
    args: list[Any],
) -> None:
    """Raise ``exc`` as SQLAlchemy would have, had it run the statement: the driver's error
    translated to the DBAPI's class (the dialect's mapping), then wrapped in a ``DBAPIError``
    and the connection invalidated if the error means it is broken (or the call was
    cancelled mid-statement)."""
    assert sync_conn is not None
    try:
        if isinstance(exc, Exception) and dbapi_conn is not None:
            dbapi_conn._handle_exception(exc)  # raises the translated error
        raise exc
    except BaseException as translated:
        sync_conn._handle_dbapi_exception(translated, statement, tuple(args), None, None)


async def run_script(conn: AsyncConnection, sql: str) -> None:
    """``sql``, statements without parameters, in one round trip on the driver connection
    beneath ``conn`` (asyncpg's simple query: several statements in one message), its errors
    reported as :meth:`DriverStatement.fetch` reports them. SQLAlchemy does not see what it
    does: a transaction it begins is the caller's to end before the connection goes back."""
    raw = await conn.get_raw_connection()
    driver: Any = raw.driver_connection
    try:
        await driver.execute(sql)
    except BaseException as exc:
        sync_conn, dbapi_conn = conn.sync_connection, raw.dbapi_connection
        await greenlet_spawn(_raise_as_sqlalchemy, sync_conn, dbapi_conn, exc, sql, [])
        raise  # (not reached: the handler always raises)
