"""Prometheus metrics of one worker, in a registry of its own.

Never the global default registry: several workers may share a process (``jobplane dev``, the
tests), and each one's figures are its own.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from jobplane.domain.models import Instance
from jobplane.domain.states import InstanceState
from jobplane.errors import (
    BusUnavailableError,
    StoreConflictError,
    StoreRefusedError,
    StoreUnavailableError,
)


class AttemptEnd(StrEnum):
    """How an attempt of this worker ended: the ``outcome`` label of the finished attempts
    (not :class:`jobplane.domain.models.ClaimOutcome`: what a claim did with an instance)."""

    SUCCEEDED = InstanceState.SUCCEEDED.value
    FAILED = InstanceState.FAILED.value
    CANCELLED = InstanceState.CANCELLED.value
    #: Not recorded: the lease was lost (another worker may own the instance).
    LEASE_LOST = "lease_lost"
    #: Released on shutdown (back to Enqueued, no retry used).
    RELEASED = "released"
    #: Not recorded: the worker failed to end the attempt (logged); its lease runs out.
    ERROR = "error"


class FencedWrite(StrEnum):
    """Writes of an attempt that its claim token fences: the ``write`` label of the refused."""

    CLAIM = "claim"  # the claim answered too late to run (the lease may have ended)
    HEARTBEAT = "heartbeat"
    PROGRESS = "progress"
    CHECKPOINT = "checkpoint"
    OUTCOME = "outcome"


#: Pickup lag buckets (seconds): a lone job starts within milliseconds of its publication.
PICKUP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0, 300.0)
#: (backend, kind) of every error the worker counts (see :func:`error_kind`).
ERROR_KINDS = (
    ("store", "conflict"),
    ("store", "unavailable"),
    ("store", "refused"),
    ("bus", "unavailable"),
)


class WorkerMetrics:
    """The figures a worker keeps while it runs; rendered by ``/metrics``."""

    def __init__(self, capacity: int, running: Callable[[], int], runaways: Callable[[], int]):
        self.registry = CollectorRegistry(auto_describe=True)
        Gauge(
            "jobplane_worker_capacity",
            "Jobs this worker runs at once (its concurrency)",
            registry=self.registry,
        ).set(capacity)
        Gauge(
            "jobplane_worker_running_attempts",
            "Attempts running now, runaways included",
            registry=self.registry,
        ).set_function(running)
        Gauge(
            "jobplane_worker_runaway_jobs",
            "Jobs running past their timeout and grace that ignore their cancellation (each "
            "holds a worker slot, a sync one its pool thread, and a concurrency slot)",
            registry=self.registry,
        ).set_function(runaways)
        self.claims = Counter(
            "jobplane_worker_claims",
            "Instances claimed by this worker",
            ["job"],
            registry=self.registry,
        )
        self.finished = Counter(
            "jobplane_worker_attempts_finished",
            "Attempts ended in this worker, by job and outcome (succeeded, failed, cancelled; "
            f"{AttemptEnd.LEASE_LOST}: not recorded, the lease was lost; "
            f"{AttemptEnd.RELEASED}: released on shutdown)",
            ["job", "outcome"],
            registry=self.registry,
        )
        self.runaways = Counter(
            "jobplane_worker_runaways",
            "Jobs (sync or async) that were seen to ignore their timeout",
            ["job"],
            registry=self.registry,
        )
        self.lease_lost_writes = Counter(
            "jobplane_worker_lease_lost_writes",
            "Writes refused because the attempt no longer held its claim token "
            "(heartbeat, progress, checkpoint, outcome)",
            ["write"],
            registry=self.registry,
        )

        self.pickup_lag = Histogram(
            "jobplane_worker_pickup_lag_seconds",
            "Time from an instance's publication (Enqueued) to its claim (Processing) by "
            "this worker, on the store's clock",
            buckets=PICKUP_BUCKETS,
            registry=self.registry,
        )
        self.backend_errors = Counter(
            "jobplane_worker_backend_errors",
            "Store and bus errors this worker met (each failed try counts), by backend "
            "(store, bus) and kind (conflict: lost to a concurrent transaction after the "
            "store's own retries; unavailable: not reachable; refused: the database rejected "
            "the statement for its data)",
            ["backend", "kind"],
            registry=self.registry,
        )
        for backend, kind in ERROR_KINDS:  # every series exists from the start
            self.backend_errors.labels(backend, kind)
        # The series of the per-job counters, kept by label values: ``labels()`` checks its
        # arguments and takes a lock on every call, about 5 % of a worker's CPU when it runs
        # thousands of no-op jobs a second (docs/benchmarks.md, "Drain: CPU per job").
        self._claims_by_job: dict[str, Counter] = {}
        self._finished_by_job: dict[tuple[str, str], Counter] = {}

    def claimed(self, job: str) -> None:
        """Count an instance of ``job`` claimed."""
        series = self._claims_by_job.get(job)
        if series is None:
            series = self._claims_by_job[job] = self.claims.labels(job=job)
        series.inc()

    def ended(self, job: str, outcome: str) -> None:
        """Count an attempt of ``job`` ended with ``outcome`` (an :class:`AttemptEnd`)."""
        series = self._finished_by_job.get((job, outcome))
        if series is None:
            series = self.finished.labels(job=job, outcome=outcome)
            self._finished_by_job[(job, outcome)] = series
        series.inc()

    def picked_up(self, instance: Instance) -> None:
        """Observe a claimed instance's pickup lag: claim time minus publication time."""
        published = instance.published_at or instance.created_at
        if instance.started_at is not None:
            lag = (instance.started_at - published).total_seconds()
            self.pickup_lag.observe(max(lag, 0.0))

    def backend_error(self, exc: BaseException) -> None:
        """Count ``exc`` if it is a store or bus error."""
        found = error_kind(exc)
        if found is not None:
            self.backend_errors.labels(*found).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def error_kind(exc: BaseException) -> tuple[str, str] | None:
    """``(backend, kind)`` of a store or bus error; ``None`` for anything else."""
    if isinstance(exc, StoreConflictError):
        return "store", "conflict"
    if isinstance(exc, StoreUnavailableError):
        return "store", "unavailable"
    if isinstance(exc, StoreRefusedError):
        return "store", "refused"
    if isinstance(exc, BusUnavailableError):
        return "bus", "unavailable"
    return None
