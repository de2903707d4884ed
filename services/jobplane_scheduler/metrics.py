"""Prometheus metrics of one scheduler replica, in a registry of its own (several schedulers
may share a process: ``jobplane dev``, the tests).

No label names an instance or a job: a cluster has few queues and policies but may have any
number of jobs, and every series costs Prometheus memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from jobplane.domain.models import Instance, JobDefinition, LeaderLease
from jobplane.domain.states import InstanceState

#: Fire lag buckets (seconds): a tick is inserted within milliseconds; seconds mean trouble.
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0, 120.0)
#: Sweep duration buckets (seconds): a sweep is a handful of indexed statements.
SWEEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class SweepStep(StrEnum):
    """What a sweep step counts (the ``step`` label of ``jobplane_scheduler_swept_total``)."""

    PROMOTED = "promoted"  # due Scheduled instances → Enqueued
    EXPIRED_LEASES = "expired_leases"  # attempts whose lease ran out, released → Enqueued
    REPUBLISHED = "republished"  # Enqueued instances whose message was lost, published again
    UNKNOWN_JOBS = "unknown_jobs"  # instances of a job no worker knows → Terminated
    DEAD_WORKERS = "dead_workers"  # silent workers marked stopped
    ORPHANED_PINS = "orphaned_pins"  # instances pinned to a gone worker, unpinned
    FORGOTTEN_WORKERS = "forgotten_workers"  # workers stopped a day ago, forgotten


class SchedulerMetrics:
    """The figures a scheduler replica keeps; rendered by its probe port's ``/metrics``."""

    def __init__(self, lease: Callable[[], LeaderLease | None]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        Gauge(
            "jobplane_scheduler_leader",
            "1 while this replica holds the leader lease of its shard",
            registry=self.registry,
        ).set_function(lambda: 1 if lease() is not None else 0)
        Gauge(
            "jobplane_scheduler_leader_term",
            "Term of the leader lease this replica holds (0 while it follows)",
            registry=self.registry,
        ).set_function(lambda: _term(lease()))
        self.ticks = Counter(
            "jobplane_scheduler_ticks_fired",
            "Cron ticks fired (recorded Enqueued) by this replica while it led",
            registry=self.registry,
        )
        self.fire_lag = Histogram(
            "jobplane_scheduler_fire_lag_seconds",
            "Time from a cron tick's scheduled time to its recording in the store",
            buckets=LAG_BUCKETS,
            registry=self.registry,
        )
        self.misfires = Counter(
            "jobplane_scheduler_misfires",
            "Cron ticks recorded later than their job's misfire grace, by the job's misfire "
            "policy and what it made of the tick (fired, skipped)",
            ["policy", "outcome"],
            registry=self.registry,
        )
        self.sweep_duration = Histogram(
            "jobplane_scheduler_sweep_duration_seconds",
            "Time one leader sweep took (all its steps)",
            buckets=SWEEP_BUCKETS,
            registry=self.registry,
        )
        self.swept = Counter(
            "jobplane_scheduler_swept",
            "What the leader's sweeps handled, by step: "
            + ", ".join(step.value for step in SweepStep),
            ["step"],
            registry=self.registry,
        )
        for step in SweepStep:  # every step's series exists from the start (rate() needs it)
            self.swept.labels(step.value)

    def fired(
        self,
        instances: Sequence[Instance],
        definitions: Mapping[str, JobDefinition],
        lag_s: float | None = None,
    ) -> None:
        """Count recorded ticks: fired ones, their lag, and misfires by policy. ``instances``
        are what the store returned for the fire (a tick recorded before is returned too and
        counted again; that happens only when two leaders overlap). ``lag_s``: the fire's lag,
        for a tick written ahead and committed at its time (its creation time says the tick);
        else each instance's creation time after its tick."""
        for instance in instances:
            if instance.scheduled_at is None:
                continue
            lag = (
                (instance.created_at - instance.scheduled_at).total_seconds()
                if lag_s is None
                else lag_s
            )
            skipped = instance.state is InstanceState.SKIPPED
            if not skipped:
                self.ticks.inc()
                self.fire_lag.observe(max(lag, 0.0))
            definition = definitions.get(instance.job_key)
            if definition is not None and (skipped or lag > definition.options.misfire_grace_s):
                outcome = "skipped" if skipped else "fired"
                self.misfires.labels(definition.options.misfire.value, outcome).inc()

    def count(self, step: SweepStep, handled: Sequence[object]) -> None:
        self.swept.labels(step.value).inc(len(handled))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _term(lease: LeaderLease | None) -> int:
    return lease.term if lease is not None else 0
