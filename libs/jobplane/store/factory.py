"""Open the store named by a database URL."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from jobplane.errors import ConfigurationError
from jobplane.settings import normalise_database_url
from jobplane.store.postgres import PostgresStore
from jobplane.store.sql import SqlStore
from jobplane.store.sqlite import SqliteStore, sqlite_engine


def make_engine(url: str, *, pool_size: int = 10) -> AsyncEngine:
    """An engine for ``url`` (``postgresql://`` or ``sqlite:///``), with the async driver."""
    url = normalise_database_url(url)
    if url.startswith("postgresql+asyncpg://"):
        return create_async_engine(
            url, pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True
        )
    if url.startswith("sqlite+aiosqlite://"):
        return sqlite_engine(url)
    raise ConfigurationError(
        f"unsupported database URL {redact(url)!r}: use postgresql://… or sqlite:///path"
    )


def open_store(url: str, *, pool_size: int = 10) -> SqlStore:
    """A store for ``url``; it owns its engine. Call ``ping()`` to fail fast when unreachable."""
    engine = make_engine(url, pool_size=pool_size)
    if engine.dialect.name == "postgresql":
        return PostgresStore(engine)
    return SqliteStore(engine)


def redact(url: str) -> str:
    """``url`` without its password, for messages and logs."""
    scheme, sep, rest = url.partition("://")
    if "@" not in rest:
        return url
    creds, _, host = rest.rpartition("@")
    user = creds.split(":", 1)[0]
    return f"{scheme}{sep}{user}:***@{host}" if ":" in creds else url
