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
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.elements import TextClause
from sqlalchemy.sql.selectable import TextualSelect
from sqlalchemy.util import greenlet_spawn


class DriverStatement:
    """A ``text()`` statement (with ``.columns(...)``), compiled once for ``dialect`` (asyncpg),
    run with :meth:`fetch_row` or :meth:`fetch` on the driver connection of a SQLAlchemy connection.

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

    async def fetch_row(self, conn: AsyncConnection, params: Mapping[str, Any]) -> dict[str, Any]:
        """The statement's first row (it must return one), by column name."""
        found = await self.fetch(conn, params)
        if not found:
            raise LookupError("the statement returned no row")
        return found[0]

    async def fetch(self, conn: AsyncConnection, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Every row of the statement, by column name."""
        raw = await conn.get_raw_connection()
        driver: Any = raw.driver_connection
        args = [params[name] for name in self.names]
        try:
            if self._processors is None:
                self._processors = self._result_processors(await driver.prepare(self.sql))
            records = await driver.fetch(self.sql, *args)
        except BaseException as exc:
            # SQLAlchemy's own error handling (it may close the connection: in a greenlet).
            sync_conn, dbapi_conn = conn.sync_connection, raw.dbapi_connection
            await greenlet_spawn(_raise_as_sqlalchemy, sync_conn, dbapi_conn, exc, self.sql, args)
            raise  # (not reached: the handler always raises)
        processors = self._processors
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
