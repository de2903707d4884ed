"""Jobplane: a distributed job scheduler for Python services.

Declare jobs on an :class:`App`; trigger them with a :class:`Dispatcher`; run them with
``jobplane worker --app module:app`` (or everything in one process with ``jobplane dev``).

Most names below are imported on first use (PEP 562), not with the package: a worker never
builds an HTTP :class:`Client`, so it never loads httpx (nor rich, which httpx's own command
line pulls in).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jobplane.app import App, JobSpec
    from jobplane.client import AsyncClient, Client
    from jobplane.context import Cancellation, JobContext
    from jobplane.dispatch import Dispatcher
    from jobplane.domain.models import Instance, InstanceSource, NewInstance
    from jobplane.domain.options import Backoff, JobKind, JobOptions, MisfirePolicy, OnLimit
    from jobplane.domain.states import InstanceState
    from jobplane.errors import ApiError, JobplaneError

# Eager: the function ``enqueue`` shares its name with the module ``jobplane.enqueue``, and a
# lazy attribute would be shadowed by the module once anything imported it first.
from jobplane.enqueue import enqueue, enqueue_async

__version__ = "0.1.0"

#: Each public name and the module that defines it.
_HOMES = {
    "ApiError": "jobplane.errors",
    "App": "jobplane.app",
    "AsyncClient": "jobplane.client",
    "Backoff": "jobplane.domain.options",
    "Cancellation": "jobplane.context",
    "Client": "jobplane.client",
    "Dispatcher": "jobplane.dispatch",
    "Instance": "jobplane.domain.models",
    "InstanceSource": "jobplane.domain.models",
    "InstanceState": "jobplane.domain.states",
    "JobContext": "jobplane.context",
    "JobKind": "jobplane.domain.options",
    "JobOptions": "jobplane.domain.options",
    "JobSpec": "jobplane.app",
    "JobplaneError": "jobplane.errors",
    "MisfirePolicy": "jobplane.domain.options",
    "NewInstance": "jobplane.domain.models",
    "OnLimit": "jobplane.domain.options",
}

__all__ = [
    "ApiError",
    "App",
    "AsyncClient",
    "Backoff",
    "Cancellation",
    "Client",
    "Dispatcher",
    "Instance",
    "InstanceSource",
    "InstanceState",
    "JobContext",
    "JobKind",
    "JobOptions",
    "JobSpec",
    "JobplaneError",
    "MisfirePolicy",
    "NewInstance",
    "OnLimit",
    "__version__",
    "enqueue",
    "enqueue_async",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'jobplane' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
