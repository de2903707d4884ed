"""Wiring of the roles: build the store and the bus from settings, check them, run the role.

Everything is created here (from ``main()``), never at import time, and closed on the way out.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any
from uuid import UUID

from rich.console import Console
from rich.table import Table

from jobplane.app import load_app
from jobplane.bus.abc import Bus
from jobplane.bus.factory import open_bus
from jobplane.dispatch import Dispatcher
from jobplane.domain.models import Instance
from jobplane.errors import ConfigurationError, SchemaBehindError, StoreUnavailableError
from jobplane.settings import CommonSettings, DevSettings, MigrateSettings, WorkerSettings
from jobplane.startup import wait_until_reachable
from jobplane.store import migrate
from jobplane.store.factory import make_engine, open_store, redact
from jobplane.store.sql import SqlStore

logger = logging.getLogger(__name__)

_COMMON = set(CommonSettings.model_fields)


async def migrate_database(
    url: str, startup_timeout_s: float = 0, stop: asyncio.Event | None = None
) -> str:
    """Upgrade the schema at ``url`` to the head revision; return it. An unreachable database
    is waited for up to ``startup_timeout_s`` (see :mod:`jobplane.startup`)."""
    engine = make_engine(url)
    try:

        async def reach() -> None:
            try:
                await migrate.current_revision(engine)
            except StoreUnavailableError:
                raise
            except OSError as exc:
                raise StoreUnavailableError(f"cannot reach {redact(url)}: {exc}") from exc

        await wait_until_reachable(reach, "the database", startup_timeout_s, stop)
        await migrate.upgrade(engine)
        return await migrate.current_revision(engine) or "base"
    except StoreUnavailableError:
        raise
    except OSError as exc:
        raise StoreUnavailableError(f"cannot reach {redact(url)}: {exc}") from exc
    finally:
        await engine.dispose()


async def ensure_bootstrap_token(settings: MigrateSettings) -> None:
    """Make sure ``JOBPLANE_BOOTSTRAP_ADMIN_TOKEN`` (if set) is an admin token."""
    if settings.bootstrap_admin_token is None:
        return
    from jobplane.auth import Role

    async with open_checked_store(settings) as store:
        info, created = await store.ensure_token(
            settings.bootstrap_admin_token.get_secret_value(),
            "bootstrap-admin",
            Role.ADMIN,
            "migrate",
        )
    if created:
        logger.info(
            "created the bootstrap admin token %s (%s…)",
            info.id,
            info.hint,
            extra={"action": "token.bootstrap_created", "token_id": str(info.id)},
        )
    elif info.revoked_at is not None:
        logger.warning(
            "the bootstrap admin token %s was revoked; it stays revoked",
            info.id,
            extra={"action": "token.bootstrap_revoked", "token_id": str(info.id)},
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
        bus = open_bus(settings.redis_url, settings.key_prefix)
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
        await store.ping()
        revision = await migrate.current_revision(store.engine)
    except StoreUnavailableError as exc:
        raise StoreUnavailableError(f"cannot reach the database {redact(url)}: {exc}") from exc
    head = migrate.head_revision()
    if revision == head:
        return
    if revision is None or migrate.is_ancestor(revision):
        raise SchemaBehindError(
            f"database {redact(url)} is at schema revision {revision or 'none'}, "
            f"this version needs {head}: run `jobplane migrate`"
        )
    raise ConfigurationError(
        f"database {redact(url)} is at schema revision {revision}, unknown to this version "
        f"(which needs {head}): it was migrated by a newer Jobplane"
    )


async def run_worker(app_path: str, settings: WorkerSettings, stop: asyncio.Event) -> None:
    from jobplane_worker.worker import Worker

    app = load_app(app_path)
    if settings.redis_url.startswith("memory://"):
        logger.warning(
            "JOBPLANE_REDIS_URL is not set: the in-process bus only carries jobs triggered "
            "in this process (use `jobplane dev` for that)",
            extra={"action": "worker.memory_bus"},
        )
    async with backends(settings, stop) as (store, bus):
        await Worker(app, store, bus, settings).run(stop)


async def run_dev(
    app_path: str,
    settings: DevSettings,
    stop: asyncio.Event,
    requests: Sequence[tuple[str, Any]],
    exit_when_done: bool,
    api_port: int = 0,
) -> None:
    """Every role in one process: migrate, run a worker and a scheduler, trigger
    ``requests``."""
    from jobplane_scheduler.scheduler import Scheduler
    from jobplane_scheduler.settings import SchedulerSettings
    from jobplane_worker.worker import Worker

    app = load_app(app_path)
    await migrate_database(settings.database_url, settings.startup_timeout_s, stop)
    async with backends(settings, stop) as (store, bus):
        worker = Worker(app, store, bus, settings)
        running = asyncio.create_task(worker.run(stop))
        scheduling: asyncio.Task[None] | None = None
        serving: asyncio.Task[None] | None = None
        triggered: list[Instance] = []
        try:
            await _wait_registered(store, app.jobs.keys(), running)
            scheduler_settings = SchedulerSettings(**settings.model_dump(include=_COMMON))
            scheduler = Scheduler(store, bus, scheduler_settings)
            scheduling = asyncio.create_task(scheduler.run(stop))
            if api_port:
                serving = asyncio.create_task(_serve_dev_api(settings, store, bus, api_port, stop))
            dispatcher = Dispatcher(store, bus)
            for key, args in requests:
                triggered.append(await dispatcher.trigger(key, args, actor="dev"))
            if exit_when_done:
                await _until_ended(store, [i.id for i in triggered], running)
                stop.set()
            await running
        finally:
            # Whatever happened (a bad trigger, Ctrl-C), the roles stop cleanly before the
            # store and bus close under them.
            stop.set()
            await asyncio.gather(running, *[t for t in (scheduling, serving) if t])
        if triggered:
            # Not a terminal (a pipe, a log): wide enough that rows are never wrapped.
            console = Console() if sys.stdout.isatty() else Console(width=200)
            console.print(await summary(store, [i.id for i in triggered]))


async def _serve_dev_api(
    settings: DevSettings, store: SqlStore, bus: Bus, port: int, stop: asyncio.Event
) -> None:
    """The API of ``jobplane dev``: loopback only, and without auth, which it says."""
    from jobplane_api.main import serve
    from jobplane_api.settings import ApiSettings

    api_settings = ApiSettings(
        **settings.model_dump(include=_COMMON), host="127.0.0.1", port=port, auth_enabled=False
    )
    logger.warning(
        "dev API on http://127.0.0.1:%d without authentication (loopback only)",
        port,
        extra={"action": "dev.api_open"},
    )
    await serve(api_settings, stop, store=store, bus=bus)


async def _wait_registered(store: SqlStore, keys: Any, running: asyncio.Task[None]) -> None:
    while not running.done():
        if {d.key for d in await store.list_definitions(list(keys))} == set(keys):
            return
        await asyncio.sleep(0.02)
    await running  # it failed: raise its error


async def _until_ended(store: SqlStore, ids: list[UUID], running: asyncio.Task[None]) -> None:
    while not running.done():
        instances = [await store.get_instance(i) for i in ids]
        if all(i.state.is_terminal for i in instances):
            return
        await asyncio.sleep(0.05)


async def summary(store: SqlStore, ids: list[UUID]) -> Table:
    """A table of instances with their history, for the terminal."""
    table = Table(title="Jobplane instances", show_lines=True)
    for column in ("instance", "job", "state", "result / error", "history"):
        table.add_column(column)
    for instance_id in ids:
        instance: Instance = await store.get_instance(instance_id)
        history = await store.transitions(instance_id)
        steps = " → ".join(t.to_state.value for t in history)
        outcome = (
            f"{instance.error.type}: {instance.error.message}"
            if instance.error
            else repr(instance.result)
        )
        table.add_row(str(instance.id), instance.job_key, instance.state.value, outcome, steps)
    return table
