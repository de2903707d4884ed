"""The job SDK: declaring jobs, binding arguments and resources, loading an app."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from uuid import uuid4

import pytest
from pydantic import BaseModel, ValidationError

from jobplane import App, JobContext
from jobplane.app import load_app
from jobplane.errors import ConfigurationError, InvalidOptionsError


class Args(BaseModel):
    n: int


def _ctx(key: str) -> JobContext:
    return JobContext(instance_id=uuid4(), job_key=key, attempt=1, scheduled_at=None, worker_id="w")


def test_triggered_job_publishes_its_argument_schema_and_binds() -> None:
    app = App()

    @app.triggered(key="double", retries=2, queue="math")
    async def double(ctx: JobContext, args: Args, cache: dict[str, int]) -> int:
        return args.n * 2

    spec = app.jobs["double"]
    assert spec.options.retries == 2 and spec.options.queue == "math" and spec.is_async
    schema = spec.args_schema()
    assert schema is not None and schema["properties"]["n"]["type"] == "integer"
    ctx = _ctx("double")
    kwargs = spec.bind(ctx, {"n": 3}, {"cache": {}})
    assert kwargs["ctx"] is ctx and kwargs["args"] == Args(n=3) and kwargs["cache"] == {}
    with pytest.raises(ValidationError):
        spec.bind(ctx, {"n": "x"}, {"cache": {}})
    with pytest.raises(ConfigurationError, match="cache"):
        spec.bind(ctx, {"n": 1}, {})


def test_a_resource_parameter_with_a_default_takes_it_unless_a_hook_returns_one() -> None:
    """A parameter with a default was a resource like any other: every attempt failed with
    "needs resource" unless a startup hook returned one by its name."""
    app = App()

    @app.triggered()
    async def tuned(ctx: JobContext, retries_left: int = 3, *rest: Any, **more: Any) -> int:
        return retries_left

    spec = app.jobs["tuned"]
    ctx = _ctx("tuned")
    assert spec.bind(ctx, None, {}) == {"ctx": ctx}  # the function's default applies
    assert spec.bind(_ctx("tuned"), None, {"retries_left": 7})["retries_left"] == 7
    assert spec.missing_resources({}) == []  # (nor *rest, **more: nothing is passed by them)

    @app.triggered()
    async def needs(mailer: object, limit: int = 1) -> None: ...

    assert app.jobs["needs"].missing_resources({}) == ["mailer"]
    assert app.jobs["needs"].missing_resources({"mailer": object()}) == []


def test_recurring_job_defaults_key_and_description() -> None:
    app = App(queue="ops")

    @app.recurring("0 * * * *", timezone="Europe/Berlin")
    def hourly() -> None:
        """Runs every hour."""

    spec = app.jobs["hourly"]
    assert spec.options.kind == "recurring" and spec.options.cron == "0 * * * *"
    assert spec.options.description == "Runs every hour." and spec.options.queue == "ops"
    assert not spec.is_async and spec.args_schema() is None


def test_bad_declarations_fail_at_import_with_the_field() -> None:
    app = App()
    with pytest.raises(InvalidOptionsError) as info:

        @app.recurring("not a cron")
        def broken() -> None: ...

    assert info.value.field == "cron"

    @app.triggered()
    def once() -> None: ...

    with pytest.raises(InvalidOptionsError, match="twice"):

        @app.triggered(key="once")
        def again() -> None: ...

    with pytest.raises(InvalidOptionsError) as info:

        @app.recurring("* * * * *")
        def with_args(args: Args) -> None: ...

    assert info.value.field == "args"


@pytest.mark.parametrize(
    "name", ["acme/billing", "", "-acme", "acme jobs", "é", "a" * 201, "acme\n"]
)
def test_an_app_name_outside_the_job_key_characters_is_refused(name: str) -> None:
    """The name is a path segment of the dashboard's app pages: "acme/billing" made them 404."""
    with pytest.raises(ValueError, match="must be 1-200 characters of letters") as info:
        App(name)
    assert isinstance(info.value, InvalidOptionsError) and info.value.field == "name"


@pytest.mark.parametrize("name", ["acme", "acme.billing", "Acme_Billing-2", "acme:jobs", "a" * 200])
def test_an_app_name_of_job_key_characters_is_accepted(name: str) -> None:
    assert App(name).name == name


async def test_lifespan_runs_hooks_in_order() -> None:
    app = App()
    events: list[str] = []

    @app.on_startup
    async def start() -> Mapping[str, Any]:
        events.append("start")
        return {"db": "pool"}

    @app.on_shutdown
    async def stop(resources: Mapping[str, Any]) -> None:
        events.append(f"stop {resources['db']}")

    async with app.lifespan() as resources:
        assert resources == {"db": "pool"}
    assert events == ["start", "stop pool"]


def test_load_app() -> None:
    assert isinstance(load_app("examples.hello:app"), App)
    with pytest.raises(ConfigurationError, match="cannot import"):
        load_app("no_such_module:app")
    with pytest.raises(ConfigurationError, match=r"not a jobplane\.App"):
        load_app("examples.hello:greet")


def test_a_bad_option_names_the_job_it_is_about() -> None:
    """An app of many jobs that declares one with a cron that never fires, or an unknown
    zone, failed to load with "cron: never fires: …" alone: which job, the operator had to
    find. The error keeps its field and names the job and its function."""
    app = App("named")
    with pytest.raises(InvalidOptionsError) as refused:

        @app.recurring("0 0 31 2 *")
        def never() -> None: ...

    assert refused.value.field == "cron"
    assert f"(job 'never', {__name__}.test_a_bad_option_names_the_job_it_is_about" in str(
        refused.value
    )
    with pytest.raises(InvalidOptionsError, match=r"unknown IANA .* \(job 'mars', ") as zone:
        app.recurring("* * * * *", key="mars", timezone="Mars/Olympus")(lambda: None)
    assert zone.value.field == "timezone" and app.jobs == {}
