"""What the ``jobplane`` command wires itself: the bootstrap admin token of ``jobplane migrate``,
and ``jobplane dev`` (every role in one process: worker, scheduler, optionally the API).

Everything is created here (from the command), never at import time, and closed on the way out.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence
from typing import Any
from uuid import UUID

from rich.console import Console
from rich.table import Table

from jobplane.app import load_app
from jobplane.backends import backends, migrate_database, open_checked_store
from jobplane.bus.abc import Bus
from jobplane.dispatch import Dispatcher
from jobplane.domain.models import Instance
from jobplane.serving import bind
from jobplane.settings import CommonSettings
from jobplane.store.abc import Store
from jobplane_cli.settings import DevSettings, MigrateSettings

logger = logging.getLogger(__name__)

_COMMON = set(CommonSettings.model_fields)


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
    for spec in app.jobs.values():
        if spec.options.queue not in settings.queues:
            # Everything runs in this one worker: with nothing else to consume the job's
            # queue, its instances wait for good (and --exit-when-done for them).
            logger.warning(
                "job %s is on queue %r, which this dev worker does not consume (queues: %s): "
                "its instances will wait",
                spec.key,
                spec.options.queue,
                ", ".join(settings.queues),
                extra={"action": "dev.queue_not_consumed", "job_key": spec.key},
            )
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
            async with Dispatcher(store, bus) as dispatcher:
                for key, args in requests:
                    triggered.append(await dispatcher.trigger(key, args, actor="dev"))
            if exit_when_done:
                await _until_ended(store, [i.id for i in triggered], running)
                stop.set()
            roles = {"worker": running, "scheduler": scheduling, "api": serving}
            await _until_a_role_ends({k: t for k, t in roles.items() if t is not None}, stop)
        finally:
            # Whatever happened (a bad trigger, Ctrl-C), the roles stop cleanly before the
            # store and bus close under them.
            stop.set()
            await asyncio.gather(running, *[t for t in (scheduling, serving) if t])
        if triggered:
            # Not a terminal (a pipe, a log): wide enough that rows are never wrapped.
            console = Console() if sys.stdout.isatty() else Console(width=200)
            console.print(await summary(store, [i.id for i in triggered]))


async def _until_a_role_ends(roles: dict[str, asyncio.Task[None]], stop: asyncio.Event) -> None:
    """Wait for the stop; a role that ends before it (a fault) ends them all with its error.
    Only the worker was watched: a scheduler that died left the process up without cron
    ticks, promotions or sweeps, its API still answering ready."""
    done, _ = await asyncio.wait(roles.values(), return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        return
    for name, task in roles.items():
        if task in done:
            task.result()  # its error, if it failed
            raise RuntimeError(f"the {name} stopped on its own")


async def _serve_dev_api(
    settings: DevSettings, store: Store, bus: Bus, port: int, stop: asyncio.Event
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
    # Bound here: a port in use is this role's error (one line, the other roles stopped
    # cleanly), where uvicorn exited the process from inside its task with its own status.
    sock = bind("127.0.0.1", port)
    try:
        await serve(api_settings, stop, store=store, bus=bus, sockets=[sock])
    finally:
        sock.close()


async def _wait_registered(store: Store, keys: Any, running: asyncio.Task[None]) -> None:
    while not running.done():
        if {d.key for d in await store.list_definitions(list(keys))} == set(keys):
            return
        await asyncio.sleep(0.02)
    await running  # it failed: raise its error


async def _until_ended(store: Store, ids: list[UUID], running: asyncio.Task[None]) -> None:
    while not running.done():
        instances = [await store.get_instance(i) for i in ids]
        if all(i.state.is_terminal for i in instances):
            return
        await asyncio.sleep(0.05)


async def summary(store: Store, ids: list[UUID]) -> Table:
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
