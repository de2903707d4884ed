"""CLI commands that talk to a running API (``jobplane jobs|trigger|instances|workers``).

URL and token come from ``--url``/``--token`` or ``JOBPLANE_API_URL``/``JOBPLANE_API_TOKEN``;
``--output json`` prints raw JSON for scripts.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from jobplane.errors import ApiError, JobplaneError

if TYPE_CHECKING:
    from rich.console import Console

    from jobplane.client import Client

jobs_cli = typer.Typer(help="Job definitions (over the API).", no_args_is_help=True)
instances_cli = typer.Typer(help="Instances (over the API).", no_args_is_help=True)
workers_cli = typer.Typer(help="Workers (over the API).", no_args_is_help=True)


@functools.cache
def out() -> Console:
    """The terminal these commands print tables to. Built (and rich imported) by the first
    command that prints one: the other roles of the ``jobplane`` command load this module too,
    and an idle worker should not carry rich."""
    from rich.console import Console

    return Console()


class Output(StrEnum):
    TABLE = "table"
    JSON = "json"


Url = Annotated[str, typer.Option("--url", envvar="JOBPLANE_API_URL", help="API base URL.")]
Token = Annotated[
    str | None, typer.Option("--token", envvar="JOBPLANE_API_TOKEN", help="Bearer token.")
]
Fmt = Annotated[Output, typer.Option("--output", "-o", help="table or json.")]
DEFAULT_URL = "http://127.0.0.1:8000"


@contextmanager
def client(url: str, token: str | None) -> Iterator[Client]:
    """A client; API errors become one red line and exit status 1."""
    # httpx (and the rich and pygments its own command line imports) only for these commands.
    from jobplane.client import Client

    try:
        with Client(url, token) as c:
            yield c
    except ApiError as exc:
        errors = exc.problem.get("errors") or []
        fields = "; ".join(f"{e.get('field')}: {e.get('reason')}" for e in errors)
        typer.secho(f"error: {exc}" + (f" ({fields})" if fields else ""), err=True, fg="red")
        raise typer.Exit(1) from None
    except JobplaneError as exc:
        typer.secho(f"error: {exc}", err=True, fg="red")
        raise typer.Exit(1) from None


def show(data: Any, fmt: Output, columns: list[str]) -> None:
    if fmt is Output.JSON:
        typer.echo(json.dumps(data, indent=2, default=str))
        return
    from rich.table import Table
    from rich.text import Text

    rows = data if isinstance(data, list) else [data]
    table = Table(*columns)
    for row in rows:
        # As Text: a str cell is rich markup ("[/b]" in a job's result crashed the table,
        # "[red]x[/red]" in a token's name was shown as a red "x").
        table.add_row(*(Text(_cell(row.get(c))) for c in columns))
    out().print(table)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value, default=str)


def parse_args(text: str | None) -> Any:
    """``--args`` as JSON, or ``@file`` holding JSON."""
    if text is None:
        return None
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise typer.BadParameter(
                f"cannot read {text[1:]}: {why}", param_hint="--args"
            ) from None
    try:
        return strict_json(text)
    except (ValueError, RecursionError) as exc:
        raise typer.BadParameter(f"--args is not JSON: {_why(exc)}") from None


def strict_json(text: str) -> Any:
    """JSON as the API takes it: NaN and Infinity, which Python's reader takes and no JSON
    encoder sends, are refused (a ValueError traceback at the request)."""

    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not a JSON number")

    return json.loads(text, parse_constant=refuse)


def _why(exc: BaseException) -> str:
    if isinstance(exc, RecursionError):
        return "nested too deep"  # (a RecursionError's traceback, 5,000 brackets deep)
    return str(exc)


JOB_COLUMNS = ["key", "version", "paused", "runners", "next_fire_times"]
INSTANCE_COLUMNS = ["id", "job_key", "state", "attempt", "worker_id", "created_at", "reason"]


@jobs_cli.command("ls")
def jobs_ls(
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Fmt = Output.TABLE,
    kind: str | None = None,
    queue: str | None = None,
    paused: Annotated[
        bool | None,
        typer.Option("--paused/--no-paused", help="Only paused, or only running, jobs."),
    ] = None,
    text: Annotated[
        str | None, typer.Option("--text", help="Text in the key, name or description.")
    ] = None,
) -> None:
    """List job definitions."""
    with client(url, token) as c:
        show(c.jobs(kind=kind, queue=queue, paused=paused, q=text), output, JOB_COLUMNS)


@jobs_cli.command("show")
def jobs_show(
    key: str, url: Url = DEFAULT_URL, token: Token = None, output: Fmt = Output.JSON
) -> None:
    """Show one job: options, version, argument schema, next fire times."""
    with client(url, token) as c:
        show(c.job(key), output, JOB_COLUMNS)


@jobs_cli.command("edit")
def jobs_edit(
    key: str,
    set_: Annotated[list[str], typer.Option("--set", help="option=JSON value (repeatable).")],
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Fmt = Output.TABLE,
) -> None:
    """Edit options, e.g. ``--set retries=3 --set 'cron="*/5 * * * *"'``."""
    changes: dict[str, Any] = {}
    for item in set_:
        name, _, raw = item.partition("=")
        try:
            changes[name] = strict_json(raw)
        except json.JSONDecodeError:
            changes[name] = raw  # a bare string
        except (ValueError, RecursionError) as exc:
            raise typer.BadParameter(f"{name}: {_why(exc)}", param_hint="--set") from None
    with client(url, token) as c:
        version = c.job(key)["version"]
        show(c.edit_job(key, version, **changes), output, JOB_COLUMNS)


VERSION_COLUMNS = ["version", "action", "actor", "at", "paused", "rolled_back_to"]


@jobs_cli.command("history")
def jobs_history(
    key: str, url: Url = DEFAULT_URL, token: Token = None, output: Fmt = Output.TABLE
) -> None:
    """Every saved version of a job, newest first: who, when, why (``-o json`` for options)."""
    with client(url, token) as c:
        show(c.versions(key), output, VERSION_COLUMNS)


@jobs_cli.command("rollback")
def jobs_rollback(
    key: str,
    to_version: Annotated[int, typer.Argument(help="The version whose options to restore.")],
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Fmt = Output.TABLE,
) -> None:
    """Restore the options of an older version, saved as a new version."""
    with client(url, token) as c:
        version = c.job(key)["version"]
        show(c.rollback(key, to_version, version=version), output, JOB_COLUMNS)


@jobs_cli.command("pause")
def jobs_pause(
    key: str, url: Url = DEFAULT_URL, token: Token = None, output: Fmt = Output.TABLE
) -> None:
    """Pause a job (no fires until resumed)."""
    with client(url, token) as c:
        show(c.pause(key), output, JOB_COLUMNS)


@jobs_cli.command("resume")
def jobs_resume(
    key: str, url: Url = DEFAULT_URL, token: Token = None, output: Fmt = Output.TABLE
) -> None:
    """Resume a job (missed ticks follow its misfire policy)."""
    with client(url, token) as c:
        show(c.resume(key), output, JOB_COLUMNS)


def trigger(
    key: str,
    args: Annotated[str | None, typer.Option("--args", help="JSON, or @file.json.")] = None,
    delay: Annotated[float | None, typer.Option("--delay", help="Seconds from now.")] = None,
    wait: Annotated[
        bool, typer.Option("--wait", help="Wait for the end, showing progress.")
    ] = False,
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Fmt = Output.TABLE,
) -> None:
    """Trigger a job; with --wait, follow it live and exit 1 unless it Succeeded."""
    arguments = parse_args(args)  # a bad --args is reported before any request
    with client(url, token) as c:
        instance = c.trigger(key, arguments, delay_s=delay)
        if wait:
            instance = _follow(c, instance["id"])
        show(instance, output, [*INSTANCE_COLUMNS, "result"])
    if wait and instance["state"] != "succeeded":
        raise typer.Exit(1)


def _follow(c: Client, instance_id: str) -> dict[str, Any]:
    from rich.text import Text

    with out().status("waiting…") as status:
        while True:
            found = c.instance(instance_id)
            progress = found.get("progress")
            text = f"{found['state']}"
            if progress is not None:
                text += f" {progress:.0%} {found.get('progress_message') or ''}"
            status.update(Text(text))  # (the job's message is text, not markup)
            if found["state"] in {"succeeded", "terminated", "skipped", "cancelled"}:
                return found
            time.sleep(0.2)


@instances_cli.command("ls")
def instances_ls(
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Fmt = Output.TABLE,
    job: str | None = None,
    state: str | None = None,
    limit: int = 50,
    before: Annotated[str | None, typer.Option(help="Cursor from the previous page.")] = None,
) -> None:
    """List instances, newest first."""
    with client(url, token) as c:
        page = c.instances(job=job, state=state, limit=limit, before=before)
        if output is Output.JSON:
            show(page, output, [])
        else:
            show(page["items"], output, INSTANCE_COLUMNS)
            if page["next_cursor"]:
                typer.echo(f"more: --before {page['next_cursor']}", err=True)


@instances_cli.command("show")
def instances_show(
    instance_id: str, url: Url = DEFAULT_URL, token: Token = None, output: Fmt = Output.JSON
) -> None:
    """One instance with its transitions, result or error."""
    with client(url, token) as c:
        show(c.instance(instance_id), output, INSTANCE_COLUMNS)


@instances_cli.command("cancel")
def instances_cancel(
    instance_id: str, url: Url = DEFAULT_URL, token: Token = None, output: Fmt = Output.TABLE
) -> None:
    """Cancel an instance."""
    with client(url, token) as c:
        show(c.cancel(instance_id), output, INSTANCE_COLUMNS)


@instances_cli.command("retry")
def instances_retry(
    instance_id: str, url: Url = DEFAULT_URL, token: Token = None, output: Fmt = Output.TABLE
) -> None:
    """Retry a terminal instance (a new one, linked to it)."""
    with client(url, token) as c:
        show(c.retry(instance_id), output, [*INSTANCE_COLUMNS, "retry_of"])


@instances_cli.command("run")
def instances_run(
    instance_id: str, url: Url = DEFAULT_URL, token: Token = None, output: Fmt = Output.TABLE
) -> None:
    """Run a waiting instance now: one held by the debug mode, or a delayed one."""
    with client(url, token) as c:
        show(c.run(instance_id), output, INSTANCE_COLUMNS)


@workers_cli.command("ls")
def workers_ls(url: Url = DEFAULT_URL, token: Token = None, output: Fmt = Output.TABLE) -> None:
    """Registered workers and what each runs now."""
    with client(url, token) as c:
        show(
            c.workers(),
            output,
            ["id", "host", "queues", "capacity", "heartbeat_at", "stopped_at", "running"],
        )
