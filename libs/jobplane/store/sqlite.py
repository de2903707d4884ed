"""The embedded default: a SQLite file. Every transaction is ``BEGIN IMMEDIATE``, so writes are
serialised and the generic statements of :class:`SqlStore` cannot race."""

from __future__ import annotations

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


def sqlite_engine(url: str, **kwargs: Any) -> AsyncEngine:
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
