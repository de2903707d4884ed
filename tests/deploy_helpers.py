"""What the deployment files are checked against: the CLI's own parser, the settings classes,
the routes each role really serves."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import typer
from pydantic_settings import BaseSettings
from starlette.applications import Starlette
from starlette.routing import Route

from jobplane.settings import CommonSettings
from jobplane_api.main import create_app
from jobplane_api.settings import ApiSettings
from jobplane_cli.main import cli
from jobplane_cli.settings import DevSettings, MigrateSettings
from jobplane_scheduler.health import health_app as scheduler_probes
from jobplane_scheduler.settings import SchedulerSettings
from jobplane_worker.health import health_app as worker_probes
from jobplane_worker.settings import WorkerSettings

SETTINGS: tuple[type[BaseSettings], ...] = (
    CommonSettings,
    WorkerSettings,
    DevSettings,
    MigrateSettings,
    SchedulerSettings,
    ApiSettings,
)
#: The remote client's options read from the environment (``jobplane trigger`` and friends).
CLIENT_ENV = {"JOBPLANE_API_URL", "JOBPLANE_API_TOKEN"}

#: The container image's default working directory is /app, where the examples are.
IMAGE_APPS = {"examples.hello:app", "examples.shop:app"}


def setting_env_names() -> set[str]:
    """Every ``JOBPLANE_*`` variable a settings class reads."""
    names = {f"JOBPLANE_{field.upper()}" for cls in SETTINGS for field in cls.model_fields}
    return names | CLIENT_ENV


def unknown_env_names(names: Sequence[str]) -> list[str]:
    known = setting_env_names()
    return [n for n in names if n.startswith("JOBPLANE_") and n not in known]


def parse_command(args: Sequence[str]) -> tuple[str, dict[str, Any]]:
    """``jobplane ARGS`` parsed by the CLI's own parser (click, under typer): the role and its
    parameters. An unknown role or option, or a bad value, raises click's usage error."""
    group = typer.main.get_command(cli)
    root = group.make_context("jobplane", [], resilient_parsing=True)
    assert isinstance(group, typer.core.TyperGroup)
    name, *rest = args
    command = group.get_command(root, name)
    if command is None:
        raise AssertionError(f"jobplane has no command {name!r}")
    return name, command.make_context(name, list(rest), parent=root).params


def routes(role: str) -> set[str]:
    """The GET paths a role serves on its HTTP port (the api) or probe port (the others)."""
    if role == "api":
        paths = create_app(ApiSettings()).openapi()["paths"]
        return {path for path, operations in paths.items() if "get" in operations}
    # The probe apps are built with no role behind them: their routes are read, never served.
    if role == "scheduler":
        app: Starlette = scheduler_probes(None)  # type: ignore[arg-type]  # routes only
    elif role == "worker":
        app = worker_probes(None)  # type: ignore[arg-type]  # routes only
    else:
        return set()
    return {r.path for r in app.routes if isinstance(r, Route) and "GET" in (r.methods or ())}


def seconds(duration: str | int | float) -> float:
    """A compose duration (``45s``, ``1m30s``) or a number of seconds."""
    if isinstance(duration, int | float):
        return float(duration)
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert parts and "".join(a + u for a, u in parts) == duration, duration
    return sum(float(amount) * units[unit] for amount, unit in parts)
