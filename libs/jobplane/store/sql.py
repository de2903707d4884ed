"""The store on SQLAlchemy Core, shared by both backends (see :mod:`jobplane.store.base`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jobplane.store.abc import Store
from jobplane.store.base import logger
from jobplane.store.bulk import OperatorStore
from jobplane.store.cluster import ClusterStore
from jobplane.store.definitions import DefinitionStore
from jobplane.store.instances import InstanceStore
from jobplane.store.lifecycle import LifecycleStore
from jobplane.store.releases import ReleaseStore
from jobplane.store.stats import StatsStore
from jobplane.store.sweeps import SweepStore
from jobplane.store.timers import TimerStore
from jobplane.store.tokens import TokenStore
from jobplane.store.workload import WorkloadStore


class SqlStore(
    DefinitionStore,
    InstanceStore,
    LifecycleStore,
    ReleaseStore,
    ClusterStore,
    SweepStore,
    TimerStore,
    TokenStore,
    StatsStore,
    OperatorStore,
    WorkloadStore,
):
    """Generic implementation of :class:`jobplane.store.abc.Store` (every role's interface);
    owns its engine."""


if TYPE_CHECKING:
    # The type checker proves the SQL stores implement every role's interface.
    _IMPLEMENTS: type[Store] = SqlStore


__all__ = ["SqlStore", "logger"]
