"""Open the store and the bus a role runs on, from its settings: each waited for, checked
reachable and at this version's schema, and closed on exit; and migrate a database.

Called from a role's entry point, never at import time.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from jobplane.bus.abc import Bus
from jobplane.bus.factory import open_bus
from jobplane.errors import (
    ConfigurationError,
    SchemaBehindError,
    StoreRefusedError,
    StoreUnavailableError,
    first_line,
)
from jobplane.settings import CommonSettings
from jobplane.startup import wait_until_reachable
from jobplane.store import schema
from jobplane.store.base import reachable
from jobplane.store.factory import make_engine, open_store, redact
from jobplane.store.sql import SqlStore


async def migrate_database(
    url: str, startup_timeout_s: float = 0, stop: asyncio.Event | None = None
) -> str:
    """Upgrade the schema at ``url`` to the head revision; return it. An unreachable database
    is waited for up to ``startup_timeout_s`` (see :mod:`jobplane.startup`)."""
    engine = make_engine(url)
    try:

        async def reach() -> None:
            try:
                async with reachable():
                    await schema.current_revision(engine)
            except StoreUnavailableError as exc:
                raise StoreUnavailableError(f"cannot reach {redact(url)}: {exc}") from exc

        await wait_until_reachable(reach, "the database", startup_timeout_s, stop)
        revision = await schema.current_revision(engine)
        known = revision in (None, schema.head_revision()) or schema.is_ancestor(revision)
        if revision is not None and not known:
            raise _unknown_revision(url, revision)  # (Alembic's: a 120-line traceback)
        # Alembic only here, for `jobplane migrate`: a role checks the schema without it.
        from alembic.util.exc import CommandError

        from jobplane.store import migrate

        try:
            async with reachable():
                await migrate.upgrade(engine)
        except (StoreRefusedError, CommandError) as exc:
            # The database holds what this schema cannot be made over: a table of another
            # application's of the same name, say (the migration is rolled back).
            raise ConfigurationError(
                f"cannot migrate {redact(url)}: {first_line(exc)} (give Jobplane a database, "
                "or a SQLite file, of its own)"
            ) from exc
        return await schema.current_revision(engine) or "base"
    except StoreUnavailableError:
        raise
    except OSError as exc:
        raise StoreUnavailableError(f"cannot reach {redact(url)}: {exc}") from exc
    finally:
        await engine.dispose()


def _unknown_revision(url: str, revision: str) -> ConfigurationError:
    return ConfigurationError(
        f"database {redact(url)} is at schema revision {revision}, unknown to this version "
        f"(which needs {schema.head_revision()}): it was migrated by a newer Jobplane"
    )


@asynccontextmanager
async def backends(
    settings: CommonSettings, stop: asyncio.Event | None = None
) -> AsyncIterator[tuple[SqlStore, Bus]]:
    """The store and the bus, checked reachable and migrated; closed on exit. Each is waited
    for up to ``settings.startup_timeout_s`` (or until ``stop`` is set) before the last error
    is raised."""
    store = open_store(
        settings.database_url,
        pool_size=settings.db_pool_size,
        limits=settings.session_limits(),
    )
    timeout = settings.startup_timeout_s

    async def check_store() -> None:
        await _check_store(store, settings.database_url)

    try:
        await wait_until_reachable(check_store, "the database", timeout, stop)
        bus = open_bus(
            settings.redis_url, settings.key_prefix, read_timeout_s=settings.bus_read_timeout_s()
        )
        try:
            await wait_until_reachable(bus.ping, "redis", timeout, stop)
            yield store, bus
        finally:
            await bus.close()
    finally:
        await store.close()


@asynccontextmanager
async def open_checked_store(settings: CommonSettings) -> AsyncIterator[SqlStore]:
    """The store alone (no bus), checked reachable and migrated; closed on exit."""
    store = open_store(
        settings.database_url,
        pool_size=settings.db_pool_size,
        limits=settings.session_limits(),
    )
    try:
        await _check_store(store, settings.database_url)
        yield store
    finally:
        await store.close()


async def _check_store(store: SqlStore, url: str) -> None:
    try:
        revision = await store.schema_revision()  # (also the reachability check)
    except StoreUnavailableError as exc:
        raise StoreUnavailableError(f"cannot reach the database {redact(url)}: {exc}") from exc
    head = schema.head_revision()
    if revision == head:
        return
    if revision is None or schema.is_ancestor(revision):
        raise SchemaBehindError(
            f"database {redact(url)} is at schema revision {revision or 'none'}, "
            f"this version needs {head}: run `jobplane migrate`"
        )
    raise _unknown_revision(url, revision)
