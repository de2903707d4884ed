"""The embedded default: a SQLite file. Every transaction is ``BEGIN IMMEDIATE``, so writes are
serialised and the generic statements of :class:`SqlStore` cannot race."""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import ColumnElement, event, literal
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from jobplane.store.sql import SqlStore
from jobplane.store.types import UtcDateTime

BUSY_TIMEOUT_MS = 30_000


class SqliteStore(SqlStore):
    def _clock(self) -> ColumnElement[datetime]:
        # One process owns the file, so its clock is the store's clock; CURRENT_TIMESTAMP
        # would only have second precision.
        return literal(datetime.now(UTC), UtcDateTime)


class _RollbackOnClose(sqlite3.Connection):
    """A connection that ends its transaction before it closes.

    SQLAlchemy closes a connection whose statement was cancelled (a task cancelled mid-query:
    a stopping role). If a cursor of it is still alive, ``sqlite3_close_v2`` only makes it a
    zombie, which keeps its open transaction - and the file's write lock - until that cursor
    is collected: every other connection's ``BEGIN IMMEDIATE`` then waits out the busy
    timeout. Rolling back first releases the lock whatever still refers to the connection.
    """

    def close(self) -> None:
        try:
            if self.in_transaction:
                self.rollback()
        finally:
            super().close()


def sqlite_engine(url: str, **kwargs: Any) -> AsyncEngine:
    kwargs.setdefault("connect_args", {})["factory"] = _RollbackOnClose
    engine = create_async_engine(url, **kwargs)

    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy's "begin" event issue BEGIN itself (pysqlite would defer it).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        cursor.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(conn: Any) -> None:
        # Take the write lock up front: a read-then-write transaction can never be overtaken.
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine
