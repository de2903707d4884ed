"""The job SDK: declare jobs with decorators on an :class:`App`.

.. code-block:: python

    app = App("shop")

    class Receipt(BaseModel):
        order_id: int

    @app.triggered(retries=3)
    async def send_receipt(ctx: JobContext, args: Receipt, mailer: Mailer) -> dict[str, str]:
        ...

    @app.recurring("*/10 * * * * *", timezone="Europe/Berlin")
    def cleanup(ctx: JobContext) -> None:
        ...

    @app.on_startup
    async def resources() -> dict[str, object]:
        return {"mailer": Mailer()}

Job functions take any of: a parameter annotated :class:`JobContext`; one annotated with a
pydantic model (the validated arguments; its JSON Schema is published when a worker registers
the job); and parameters named after resources returned by startup hooks (one with a default
takes it when no hook returns it; a worker says at start which jobs lack one).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import typing
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel

from jobplane.context import JobContext
from jobplane.domain.options import KEY_PATTERN, JobKind, JobOptions
from jobplane.errors import (
    ConfigurationError,
    InvalidOptionsError,
    StartupHookError,
    StoppedWhileStarting,
    first_line,
)

F = TypeVar("F", bound=Callable[..., Any])
Resources = Mapping[str, Any]
StartupHook = Callable[[], Awaitable[Mapping[str, Any] | None]]
ShutdownHook = Callable[[Resources], Awaitable[None]]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class JobSpec:
    """A job as declared in code: its options (as code says them) and its function."""

    options: JobOptions
    func: Callable[..., Any]
    args_model: type[BaseModel] | None
    context_param: str | None
    args_param: str | None
    resource_params: tuple[str, ...]
    #: Resource parameters with a default: the default applies when no hook returns them.
    optional_params: frozenset[str] = frozenset()

    @property
    def key(self) -> str:
        return self.options.key

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.func)

    def args_schema(self) -> dict[str, Any] | None:
        return self.args_model.model_json_schema() if self.args_model else None

    def bind(self, ctx: JobContext, args: Any, resources: Resources) -> dict[str, Any]:
        """Keyword arguments for one call: context, validated arguments, resources."""
        kwargs: dict[str, Any] = {}
        if self.context_param:
            kwargs[self.context_param] = ctx
        if self.args_param and self.args_model is not None:
            kwargs[self.args_param] = self.args_model.model_validate(args or {})
        for name in self.resource_params:
            if name in resources:
                kwargs[name] = resources[name]
            elif name not in self.optional_params:
                raise ConfigurationError(
                    f"job {self.key!r} needs resource {name!r}; return it from a startup hook"
                )
        return kwargs

    def missing_resources(self, resources: Resources) -> list[str]:
        """The resources this job needs that ``resources`` lacks (its attempts would fail)."""
        return [
            name
            for name in self.resource_params
            if name not in resources and name not in self.optional_params
        ]


class App:
    """A set of jobs plus the startup/shutdown hooks that create the resources they share."""

    def __init__(self, name: str = "jobplane", *, queue: str = "default") -> None:
        # The name is a path segment of the dashboard's app pages (/apps/{name}/…): the
        # characters of a job key, so a "/" never makes them unreachable.
        if not isinstance(name, str) or not KEY_PATTERN.match(name):
            raise InvalidOptionsError(
                "name",
                f"App name {name!r} must be 1-200 characters of letters, digits, '_', '.', "
                "':' or '-', starting with a letter or digit (as a job key)",
            )
        self.name = name
        self.default_queue = queue
        self.jobs: dict[str, JobSpec] = {}
        self._startup: list[StartupHook] = []
        self._shutdown: list[ShutdownHook] = []

    def triggered(self, key: str | None = None, **options: Any) -> Callable[[F], F]:
        """Declare a triggered job (run by code, REST, CLI or dashboard, with arguments)."""
        return self._declare(JobKind.TRIGGERED, key, options)

    def recurring(
        self, cron: str | None = None, *, key: str | None = None, **options: Any
    ) -> Callable[[F], F]:
        """Declare a recurring job; without ``cron`` it only runs when triggered by hand."""
        return self._declare(JobKind.RECURRING, key, {"cron": cron, **options})

    def on_startup(self, hook: StartupHook) -> StartupHook:
        """Register a hook run once when a worker starts; the mapping it returns is merged into
        the resources injected into jobs by parameter name."""
        self._startup.append(hook)
        return hook

    def on_shutdown(self, hook: ShutdownHook) -> ShutdownHook:
        """Register a hook run when the worker stops, after every job has ended."""
        self._shutdown.append(hook)
        return hook

    @asynccontextmanager
    async def lifespan(self, stop: asyncio.Event | None = None) -> AsyncIterator[Resources]:
        """Run the startup hooks, yield the resources, run the shutdown hooks (reversed). A
        worker runs it as it starts: it logs which jobs need a resource no hook returned
        (each of their attempts fails with ConfigurationError, found only at the first
        attempt before). A hook that raises is logged with its traceback and raised as
        :class:`StartupHookError`; one still running when ``stop`` is set is cancelled, and
        :class:`StoppedWhileStarting` raised (a worker whose hook hung ignored SIGTERM)."""
        resources: dict[str, Any] = {}
        async with AsyncExitStack() as stack:
            for hook in self._shutdown:
                stack.push_async_callback(hook, resources)
            for startup in self._startup:
                resources.update(await _started(startup, stop) or {})
            for spec in self.jobs.values():
                if missing := spec.missing_resources(resources):
                    logger.error(
                        "job %s needs resource(s) %s, which no startup hook returned: each of "
                        "its attempts will fail",
                        spec.key,
                        ", ".join(repr(name) for name in missing),
                        extra={"action": "worker.resource_missing", "job_key": spec.key},
                    )
            yield resources

    def _declare(self, kind: JobKind, key: str | None, options: dict[str, Any]) -> Callable[[F], F]:
        def decorator(func: F) -> F:
            try:
                spec = _spec_for(func, kind, key, {"queue": self.default_queue, **options})
            except InvalidOptionsError as exc:
                # Said with the job it is about: an app of many jobs failed to load with
                # "cron: never fires: …" alone.
                where = f"job {key or func.__name__!r}, {func.__module__}.{func.__qualname__}"
                raise type(exc)(exc.field, f"{exc.reason} ({where})") from None
            if spec.key in self.jobs:
                raise InvalidOptionsError("key", f"job {spec.key!r} is declared twice")
            self.jobs[spec.key] = spec
            return func

        return decorator


async def _started(hook: StartupHook, stop: asyncio.Event | None) -> Mapping[str, Any] | None:
    name = getattr(hook, "__qualname__", repr(hook))
    running = asyncio.ensure_future(hook())
    stopping = asyncio.ensure_future(stop.wait()) if stop is not None else None
    try:
        waited = {running, stopping} if stopping is not None else {running}
        await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
        if not running.done():
            running.cancel()
            await asyncio.wait({running})
            said = f"stopped while startup hook {name} ran: it was cancelled"
            logger.warning(said, extra={"action": "worker.stopped_starting"})
            raise StoppedWhileStarting(said)
        return running.result()
    except (StoppedWhileStarting, asyncio.CancelledError):
        raise
    except Exception as exc:
        logger.exception(
            "startup hook %s failed", name, extra={"action": "worker.startup_hook_failed"}
        )
        reason = f"{type(exc).__name__}: {first_line(exc)}"
        raise StartupHookError(f"startup hook {name} failed: {reason}") from exc
    finally:
        if stopping is not None:
            stopping.cancel()
        if not running.done():
            running.cancel()


def _spec_for(
    func: Callable[..., Any], kind: JobKind, key: str | None, options: dict[str, Any]
) -> JobSpec:
    options.setdefault("description", inspect.getdoc(func) or "")
    parsed = JobOptions.parse(key=key or func.__name__, kind=kind, **options)
    hints = typing.get_type_hints(func)
    context_param = args_param = None
    args_model: type[BaseModel] | None = None
    resources: list[str] = []
    optional: set[str] = set()
    for name, parameter in inspect.signature(func).parameters.items():
        hint = hints.get(name)
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue  # (``*args``, ``**kwargs``: nothing is passed by them)
        if hint is JobContext:
            context_param = name
        elif isinstance(hint, type) and issubclass(hint, BaseModel):
            if args_model is not None:
                raise InvalidOptionsError("args", f"{func.__name__} takes two argument models")
            args_param, args_model = name, hint
        else:
            resources.append(name)
            if parameter.default is not parameter.empty:
                optional.add(name)  # (its default, unless a startup hook returns it)
    if args_model is not None and kind is JobKind.RECURRING:
        raise InvalidOptionsError("args", "recurring jobs take no arguments")
    return JobSpec(
        options=parsed,
        func=func,
        args_model=args_model,
        context_param=context_param,
        args_param=args_param,
        resource_params=tuple(resources),
        optional_params=frozenset(optional),
    )


def load_app(path: str) -> App:
    """Import ``module:attribute`` (``attribute`` defaults to ``app``) and return the App."""
    import importlib
    import os
    import sys

    # Like uvicorn: the current directory is importable, so `--app examples.hello:app` works
    # from a checkout without installing the app.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    module_name, _, attribute = path.partition(":")
    if not module_name or module_name.startswith("."):
        # ("" and ".foo" raised ValueError and TypeError from importlib: a traceback.)
        raise ConfigurationError(f"{path!r} is not module:attribute (e.g. myapp.jobs:app)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"cannot import app module {module_name!r}: {exc}") from exc
    app = getattr(module, attribute or "app", None)
    if not isinstance(app, App):
        raise ConfigurationError(f"{path!r} is not a jobplane.App")
    return app
