"""The ``jobplane`` command: one entry point, the subcommand picks the role.

This package is the composition root: it builds each role's settings and hands them to the
role's entry point (``jobplane_worker.main``, ``jobplane_scheduler.main``, ``jobplane_api.main``).
Roles are imported lazily, so ``jobplane migrate`` never loads worker code.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated, Any

import click
import typer
from pydantic import ValidationError
from pydantic_settings import SettingsError

from jobplane.errors import (
    InvalidOptionsError,
    JobplaneError,
    WorkerEvictedError,
    WorkerFailedError,
)
from jobplane.logs import configure_logging
from jobplane.settings import CommonSettings
from jobplane.telemetry import configure_tracing, shutdown_tracing
from jobplane_cli.remote import instances_cli, jobs_cli, trigger, workers_cli
from jobplane_cli.settings import DevSettings, MigrateSettings

if TYPE_CHECKING:
    from jobplane_api.settings import ApiSettings

cli = typer.Typer(
    name="jobplane",
    help="Jobplane: a distributed job scheduler for Python services.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

AppOption = Annotated[str, typer.Option("--app", help="The App to load, as module:attribute.")]
QueuesOption = Annotated[
    str | None, typer.Option("--queues", help="Comma-separated queues to consume.")
]
ConcurrencyOption = Annotated[
    int | None, typer.Option("--concurrency", min=1, help="Jobs run at once by this worker.")
]
GraceOption = Annotated[
    float | None,
    typer.Option("--grace", min=0, help="Seconds running jobs get to finish on SIGTERM."),
]
HealthPortOption = Annotated[
    int | None,
    typer.Option(
        "--health-port",
        min=0,
        max=65535,
        help="Serve /healthz, /readyz and /metrics on this port (0: off).",
    ),
]


token_cli = typer.Typer(
    help="API tokens (stored hashed; the secret is shown once).", no_args_is_help=True
)
cli.add_typer(token_cli, name="token")
cli.add_typer(jobs_cli, name="jobs")
cli.add_typer(instances_cli, name="instances")
cli.add_typer(workers_cli, name="workers")
cli.command("trigger")(trigger)


def main() -> None:
    try:
        cli()
    except ValidationError as exc:
        # A bad JOBPLANE_* setting: one line per field, never the value (it may be a secret).
        for error in exc.errors():
            name = "JOBPLANE_" + "_".join(str(part) for part in error["loc"]).upper()
            typer.secho(f"error: {name}: {error['msg']}", err=True, fg=typer.colors.RED)
        sys.exit(2)
    except SettingsError as exc:
        # A JOBPLANE_* value pydantic-settings could not even decode (JSON of a complex
        # field): one line naming the variable, never the value.
        typer.secho(f"error: {settings_error_line(exc)}", err=True, fg=typer.colors.RED)
        sys.exit(2)


def settings_error_line(exc: SettingsError) -> str:
    """``JOBPLANE_NAME: why`` for a value pydantic-settings could not decode."""
    field = re.search(r'field "(\w+)"', str(exc))
    name = f"JOBPLANE_{field.group(1).upper()}" if field else "a JOBPLANE_* variable"
    cause = f" ({exc.__cause__})" if exc.__cause__ else ""
    return f"{name}: the value cannot be read{cause}"


def run(
    coro_factory: Callable[[], Awaitable[Any]],
    settings: CommonSettings,
    static: dict[str, Any] | None = None,
) -> None:
    """Run a role; a JobplaneError (bad setting, unreachable service) is one line, exit 2.
    ``static`` fields (the role, its id) are on every JSON log line."""
    configure_logging(settings.log_level, settings.log_format, static)
    from jobplane.startup import freeze_heap_at_startup

    freeze_heap_at_startup()  # one role for the process's life: see freeze_startup_heap
    # Spans go out over OTLP only when OTEL_EXPORTER_OTLP_ENDPOINT is set.
    tracing = configure_tracing(f"jobplane-{(static or {}).get('role', 'dev')}")
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(_main(coro_factory))
    except (WorkerEvictedError, WorkerFailedError) as exc:
        # Job code may still run in pool threads, which nothing can stop but the end of the
        # process: exit now, without waiting for them (another worker owns their instances,
        # or will once their leases end).
        typer.secho(f"error: {exc}", err=True, fg=typer.colors.RED)
        logging.shutdown()
        sys.stderr.flush()
        os._exit(2)
    except JobplaneError as exc:
        # One line, never wrapped: scripts and log collectors read it.
        typer.secho(f"error: {exc}", err=True, fg=typer.colors.RED)
        raise typer.Exit(2) from None
    finally:
        if tracing is not None:
            shutdown_tracing(tracing)  # sends the spans still buffered, for 2 s at most


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """uvloop where it is installed (Linux, macOS): the same asyncio, about 10% more jobs/s."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


async def _main(coro_factory: Callable[[], Awaitable[Any]]) -> Any:
    return await coro_factory()


class _EarlySigterm:
    """A SIGTERM received while a role was still starting (see :func:`remember_early_sigterm`)."""

    seen = False

    @classmethod
    def note(cls, _signum: int, _frame: object) -> None:
        cls.seen = True


def remember_early_sigterm() -> None:
    """The first step of a long-running role: from here until its event loop takes the
    signals over (the role's own imports, settings, first connections) a SIGTERM is remembered
    and becomes the graceful stop instead of killing the process. Before this point (the
    interpreter and ``jobplane_cli.main`` loading, about a second) SIGTERM still kills it; nothing
    is held yet then."""
    _EarlySigterm.seen = False
    signal.signal(signal.SIGTERM, _EarlySigterm.note)


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (the graceful stop), already set if a SIGTERM came
    while the role was starting."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if _EarlySigterm.seen:
        stop.set()
    return stop


@cli.command()
def migrate() -> None:
    """Create or upgrade the database schema to the latest revision (and make sure
    JOBPLANE_BOOTSTRAP_ADMIN_TOKEN, if set, is an admin token)."""
    settings = MigrateSettings()

    async def go() -> None:
        from jobplane.backends import migrate_database
        from jobplane_cli.runtime import ensure_bootstrap_token

        revision = await migrate_database(
            settings.database_url, settings.startup_timeout_s, stop_on_signals()
        )
        await ensure_bootstrap_token(settings)
        typer.echo(f"database schema at revision {revision}", err=True)

    run(go, settings, {"role": "migrate"})


@cli.command()
def worker(
    app: AppOption,
    queues: QueuesOption = None,
    concurrency: ConcurrencyOption = None,
    grace: GraceOption = None,
    worker_id: Annotated[
        str | None, typer.Option("--worker-id", help="Stable id (consumer name, leases).")
    ] = None,
    health_port: HealthPortOption = None,
) -> None:
    """Run a worker: consume queues from Redis, run jobs, record outcomes in Postgres."""
    remember_early_sigterm()
    from jobplane_worker.settings import WorkerSettings

    given = _given(queues, concurrency, grace, worker_id)
    if health_port is not None:
        given["health_port"] = health_port
    settings = WorkerSettings(**given)

    async def go() -> None:
        from jobplane_worker.main import run_worker

        await run_worker(app, settings, stop_on_signals())

    run(go, settings, {"role": "worker", "worker_id": settings.worker_id})


@cli.command()
def scheduler(
    health_port: HealthPortOption = None,
) -> None:
    """Run a scheduler replica: one leader fires cron ticks, promotes delayed instances,
    releases expired leases and republishes lost messages; the others stand by."""
    remember_early_sigterm()
    from jobplane_scheduler.settings import SchedulerSettings

    given: dict[str, Any] = {} if health_port is None else {"health_port": health_port}
    settings = SchedulerSettings(**given)

    async def go() -> None:
        from jobplane_scheduler.main import run_scheduler

        await run_scheduler(settings, stop_on_signals())

    run(go, settings, {"role": "scheduler", "scheduler_id": settings.scheduler_id})


@cli.command()
def api(
    host: Annotated[str | None, typer.Option("--host", help="Interface to bind.")] = None,
    port: Annotated[int | None, typer.Option("--port", help="Port to listen on.")] = None,
    workers: Annotated[
        int | None,
        typer.Option(
            "--workers",
            min=1,
            max=64,
            help="Processes serving the API on the one port [env: JOBPLANE_API_WORKERS; "
            "default 1].",
        ),
    ] = None,
) -> None:
    """Serve the REST API (/api/v1), health, readiness and metrics."""
    remember_early_sigterm()
    from jobplane_api.settings import ApiSettings

    overrides: dict[str, Any] = {}
    if host is not None:
        overrides["host"] = host
    if port is not None:
        overrides["port"] = port
    if workers is not None:
        overrides["api_workers"] = workers
    settings = ApiSettings(**overrides)
    if settings.api_workers > 1:
        from jobplane_api.main import run_api_processes

        configure_logging(settings.log_level, settings.log_format, {"role": "api"})
        try:
            code = run_api_processes(settings, serve_api_process)
        except JobplaneError as exc:
            typer.secho(f"error: {exc}", err=True, fg=typer.colors.RED)
            raise typer.Exit(2) from None
        raise typer.Exit(code)

    async def go() -> None:
        from jobplane_api.main import run_api

        await run_api(settings, stop_on_signals())

    run(go, settings, {"role": "api"})


def serve_api_process(settings: ApiSettings, sock: socket.socket, index: int) -> None:
    """One process of ``jobplane api --workers N`` (what each spawned process runs, handed to
    :func:`jobplane_api.main.run_api_processes`): the API on the supervisor's socket."""
    from jobplane_api.main import run_api

    remember_early_sigterm()

    async def go() -> None:
        await run_api(settings, stop_on_signals(), [sock])

    try:
        run(go, settings, {"role": "api", "api_process": index})
    except (click.exceptions.Exit, typer.Exit) as exc:  # (typer's is not click's, in 0.29)
        sys.exit(exc.exit_code)


@cli.command()
def dev(
    app: AppOption,
    trigger: Annotated[
        list[str] | None,
        typer.Option("--trigger", help="KEY or KEY=JSON-args to trigger at start (repeatable)."),
    ] = None,
    exit_when_done: Annotated[
        bool, typer.Option("--exit-when-done", help="Stop once the triggered jobs have ended.")
    ] = False,
    concurrency: ConcurrencyOption = None,
    api_port: Annotated[
        int | None,
        typer.Option(
            "--api-port",
            min=0,
            max=65535,
            help="Serve the API on 127.0.0.1 at this port, without auth (0: no API). "
            "Default 8000, or none with --exit-when-done.",
        ),
    ] = None,
) -> None:
    """Run every role in one process on the embedded default (SQLite file, in-process bus)."""
    remember_early_sigterm()
    settings = DevSettings(**_given(None, concurrency, None, None))
    requests = [_parse_trigger(t) for t in trigger or []]
    port = api_port if api_port is not None else (0 if exit_when_done else 8000)

    async def go() -> None:
        from jobplane_cli.runtime import run_dev

        await run_dev(app, settings, stop_on_signals(), requests, exit_when_done, port)

    run(go, settings, {"role": "dev", "worker_id": settings.worker_id})


def _given(
    queues: str | None, concurrency: int | None, grace: float | None, worker_id: str | None
) -> dict[str, Any]:
    """Flags given on the command line; they override the JOBPLANE_* environment."""
    values: dict[str, Any] = {}
    if queues is not None:  # ("" too: it fell back to the default queue without a word)
        values["queues"] = [q.strip() for q in queues.split(",") if q.strip()]
    if concurrency is not None:
        values["concurrency"] = concurrency
    if grace is not None:
        values["grace_s"] = grace
    if worker_id:
        values["worker_id"] = worker_id
    return values


def _parse_trigger(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep:
        return key, None
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"--trigger {key}: arguments are not JSON: {exc}") from exc


@token_cli.command("create")
def token_create(
    role: Annotated[str, typer.Option("--role", help="viewer, operator or admin.")],
    name: Annotated[str, typer.Option("--name", help="What the token is for.")] = "cli",
    expires_in: Annotated[
        str | None,
        typer.Option("--expires-in", help="Lifetime: 90m, 12h, 30d… (default: until revoked)."),
    ] = None,
) -> None:
    """Create a token and print its secret (the only time it is shown). Straight from the
    database: this is also how an admin token is recovered when none is left."""
    from jobplane.auth import Role, check_token_request, parse_duration

    try:
        chosen = Role(role)
    except ValueError:
        raise typer.BadParameter("role must be viewer, operator or admin") from None
    try:
        lifetime = parse_duration(expires_in) if expires_in is not None else None
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--expires-in") from None
    try:
        check_token_request(name, lifetime)  # (as the API takes them)
    except InvalidOptionsError as exc:
        flag = "--name" if exc.field == "name" else "--expires-in"
        raise typer.BadParameter(exc.reason, param_hint=flag) from None
    settings = CommonSettings()

    async def go() -> None:
        from jobplane.backends import open_checked_store

        async with open_checked_store(settings) as store:
            info, secret = await store.create_token(name, chosen, "cli", expires_in=lifetime)
        typer.echo(f"created {info.role.value} token {info.id} ({info.name}); secret:", err=True)
        typer.echo(secret)

    run(go, settings)


@token_cli.command("ls")
def token_ls() -> None:
    """List tokens (never their secrets)."""
    settings = CommonSettings()

    async def go() -> None:
        from jobplane.backends import open_checked_store

        async with open_checked_store(settings) as store:
            now = await store.now()
            for t in await store.list_tokens():
                state = f"revoked {t.revoked_at:%Y-%m-%d}" if t.revoked_at else "live"
                if t.expires_at and not t.revoked_at:
                    # (An expired one said "live, expires <a past time>".)
                    ended = t.expires_at <= now
                    state = "expired" if ended else "live, expires"
                    state += f" {t.expires_at:%Y-%m-%d %H:%M}"
                used = f"{t.last_used_at:%Y-%m-%d %H:%M}" if t.last_used_at else "never"
                typer.echo(f"{t.id}  {t.role.value:<8} {t.hint}…  {t.name}  ({state}; used {used})")

    run(go, settings)


@token_cli.command("revoke")
def token_revoke(token_id: str) -> None:
    """Revoke a token at once."""
    from uuid import UUID

    try:
        chosen = UUID(token_id)
    except ValueError:
        raise typer.BadParameter(
            f"{token_id!r} is not a token id (a UUID, as `jobplane token ls` shows)",
            param_hint="TOKEN_ID",
        ) from None
    settings = CommonSettings()

    async def go() -> None:
        from jobplane.backends import open_checked_store

        async with open_checked_store(settings) as store:
            if not await store.revoke_token(chosen, "cli"):
                raise JobplaneError(f"no live token {token_id}")
        typer.echo(f"revoked {token_id}", err=True)

    run(go, settings)
