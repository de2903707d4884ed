"""Open the store named by a database URL."""

from __future__ import annotations

import asyncio
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import ExceptionContext
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.pool import PoolProxiedConnection

from jobplane.errors import ConfigurationError
from jobplane.settings import SessionLimits, normalise_database_url
from jobplane.store.engine import AsyncEngine, create_async_engine
from jobplane.store.postgres import PostgresStore
from jobplane.store.sql import SqlStore

#: Settings of every Postgres session. No JIT compilation: Jobplane's statements are short,
#: but the planner's cost of a few passes the threshold at which Postgres compiles a
#: statement before running it (the Jobs page's summaries over a day of 200,000 ends spent
#: 330 ms of a 420 ms execution compiling).
SERVER_SETTINGS = {"jit": "off"}


def make_engine(
    url: str, *, pool_size: int = 10, limits: SessionLimits | None = None
) -> AsyncEngine:
    """An engine for ``url`` (``postgresql://`` or ``sqlite:///``), with the async driver.
    ``limits`` apply to every Postgres session (the roles pass theirs; migrations none), and
    :data:`SERVER_SETTINGS` to every one."""
    url = normalise_database_url(url)
    if url.startswith("postgresql+asyncpg://"):
        connect_args = _session_args(limits) if limits else {"server_settings": SERVER_SETTINGS}
        engine = create_async_engine(
            url,
            pool_size=pool_size,
            max_overflow=pool_size,
            # No ping round trip per checkout (it cost as much as a trigger's insert): a
            # connection the server closed is replaced at checkout (below), and one that
            # breaks in use fails that one call as StoreUnavailableError, which every role
            # waits out, while SQLAlchemy invalidates the rest of the pool.
            pool_pre_ping=False,
            connect_args=connect_args,
        )
        event.listen(engine.sync_engine, "checkout", _replace_closed)
        event.listen(engine.sync_engine, "handle_error", _drop_when_cancelled)
        event.listen(engine.sync_engine, "handle_error", _drop_when_out_of_step)
        return engine
    if url.startswith("sqlite+aiosqlite://"):
        # Imported for SQLite only: a role on Postgres never loads sqlite3 (nor its library).
        from jobplane.store.sqlite import sqlite_engine

        return sqlite_engine(url)
    raise ConfigurationError(
        f"unsupported database URL {redact(url)!r}: use postgresql://… or sqlite:///path"
    )


def _replace_closed(_dbapi_connection: Any, _record: Any, proxy: PoolProxiedConnection) -> None:
    """Refuse a pooled connection that asyncpg already knows is closed: the server ended it
    (a restart, a failover, an administrator) and its socket said so while it sat in the
    pool. No round trip: asyncpg marks the connection when it reads the EOF. The pool then
    connects anew (``DisconnectionError`` makes it retry the checkout)."""
    driver = proxy.driver_connection
    if driver is not None and driver.is_closed():
        raise DisconnectionError("connection closed by the server while pooled")


def _drop_when_cancelled(context: ExceptionContext) -> None:
    """A statement cancelled mid-flight (the fence stopping a job that awaits a checkpoint, a
    timeout, a drain) drops its connection at once. SQLAlchemy closes such a connection
    gracefully: it waits up to 2 s for the cancel request asyncpg sends over a new connection,
    and a partition holds that request for the whole 2 s. Meanwhile the cancelled code went on
    running: a fenced job stopped up to 2 s after its fence, past the end of its lease, while
    another worker already ran the instance. Dropped, the connection closes at once, its
    cancel request with it. The server then runs the statement to its end (or to its
    ``statement_timeout``) instead of stopping it: as after any connection lost mid-statement,
    which every write of the roles is fenced or idempotent for.
    """
    connection = context.connection
    if not isinstance(context.original_exception, asyncio.CancelledError) or connection is None:
        return
    if connection.invalidated or connection.closed:
        return
    driver = connection.connection.driver_connection
    if driver is not None:
        driver.terminate()


def _drop_when_out_of_step(context: ExceptionContext) -> None:
    """A connection whose driver lost track of its own protocol (asyncpg's
    ``InternalClientError``: "cannot switch to state 15; another operation (2) is in
    progress", seen once on the leader's pooled connection after its process was frozen
    mid-statement) is dropped, and the error reported as a lost connection: the caller waits
    it out and tries again on a new one. Kept, the connection went back to the pool as it was,
    and the error was a refusal of the statement, which ended the leader's duties."""
    if not any(type(e).__name__ == "InternalClientError" for e in _chain(context)):
        return
    context.is_disconnect = True
    context.invalidate_pool_on_disconnect = False  # (only this connection is out of step)
    connection = context.connection
    if connection is None or connection.invalidated or connection.closed:
        return
    driver = connection.connection.driver_connection
    if driver is not None:
        driver.terminate()


def _chain(context: ExceptionContext) -> list[BaseException]:
    """The error SQLAlchemy handles, as the driver's adapter raised it, and its causes."""
    found: list[BaseException] = []
    error: BaseException | None = context.original_exception
    while error is not None and len(found) < 5:
        found.append(error)
        error = error.__cause__
    return found


def _session_args(limits: SessionLimits) -> dict[str, Any]:
    """asyncpg connect arguments: server-side limits sent with the session's start-up (so a
    frozen or partitioned client's transaction is ended by the server, releasing its locks),
    and client-side bounds on every command (a reply lost in a partition) and on connecting
    (a host that drops packets)."""

    def ms(seconds: float) -> str:
        return f"{max(1, round(seconds * 1000))}ms"

    keepalive = max(1, round(limits.keepalive_s))
    return {
        "server_settings": {
            "lock_timeout": ms(limits.lock_timeout_s),
            "idle_in_transaction_session_timeout": ms(limits.idle_in_transaction_timeout_s),
            "statement_timeout": ms(limits.statement_timeout_s),
            **SERVER_SETTINGS,
            "tcp_keepalives_idle": str(keepalive),
            "tcp_keepalives_interval": str(max(1, keepalive // 3)),
            "tcp_keepalives_count": "3",
            **({"application_name": limits.application_name} if limits.application_name else {}),
        },
        "command_timeout": limits.statement_timeout_s + 5,
        "timeout": limits.connect_timeout_s,
    }


def open_store(url: str, *, pool_size: int = 10, limits: SessionLimits | None = None) -> SqlStore:
    """A store for ``url``; it owns its engine. Call ``ping()`` to fail fast when unreachable."""
    engine = make_engine(url, pool_size=pool_size, limits=limits)
    if engine.dialect.name == "postgresql":
        return PostgresStore(engine)
    from jobplane.store.sqlite import SqliteStore

    return SqliteStore(engine)


def redact(url: str) -> str:
    """``url`` without its password, for messages and logs."""
    scheme, sep, rest = url.partition("://")
    if "@" not in rest:
        return url
    creds, _, host = rest.rpartition("@")
    user = creds.split(":", 1)[0]
    return f"{scheme}{sep}{user}:***@{host}" if ":" in creds else url
