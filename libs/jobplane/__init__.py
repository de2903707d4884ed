"""Jobplane: a distributed job scheduler for Python services.

Declare jobs on an :class:`App`; trigger them with a :class:`Dispatcher`; run them with
``jobplane worker --app module:app`` (or everything in one process with ``jobplane dev``).
"""

from __future__ import annotations

from jobplane.app import App, JobSpec
from jobplane.client import AsyncClient, Client
from jobplane.context import Cancellation, JobContext
from jobplane.dispatch import Dispatcher
from jobplane.domain.models import Instance, InstanceSource, NewInstance
from jobplane.domain.options import Backoff, JobKind, JobOptions, MisfirePolicy, OnLimit
from jobplane.domain.states import InstanceState
from jobplane.enqueue import enqueue, enqueue_async
from jobplane.errors import ApiError, JobplaneError

__version__ = "0.1.0"

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
