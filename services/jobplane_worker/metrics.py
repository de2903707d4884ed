"""Prometheus metrics of one worker, in a registry of its own.

Never the global default registry: several workers may share a process (``jobplane dev``, the
tests), and each one's figures are its own.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)

#: Outcome labels besides the instance states (succeeded, failed, cancelled).
LEASE_LOST = "lease_lost"
RELEASED = "released"


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
            "Sync jobs running past their timeout and grace that ignore their cancellation "
            "(each holds a pool thread and a concurrency slot)",
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
            f"{LEASE_LOST}: not recorded, the lease was lost; {RELEASED}: released on shutdown)",
            ["job", "outcome"],
            registry=self.registry,
        )
        self.runaways = Counter(
            "jobplane_worker_runaways",
            "Sync jobs that were seen to ignore their timeout",
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

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
