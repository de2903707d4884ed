"""Settings of the scheduler role (``JOBPLANE_*`` environment variables)."""

from __future__ import annotations

import os
import socket

from pydantic import Field

from jobplane.settings import CENTURY_S, CommonSettings

__all__ = ["CENTURY_S", "SchedulerSettings"]


class SchedulerSettings(CommonSettings):
    #: This replica's name in the leader lease (host and pid by default: unique per process).
    scheduler_id: str = Field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")
    #: Leader lease shard (one leader group per shard).
    shard: int = Field(default=0, ge=0)
    #: A crashed leader is replaced within this time; renewed every third of it.
    #: (At least 0.5 s: a lease of a millisecond was renewed in a loop and never held.)
    lease_ttl_s: float = Field(default=5.0, ge=0.5, le=CENTURY_S)
    #: The sweep in Postgres that finds what no event announced.
    sweep_interval_s: float = Field(default=1.0, gt=0, le=CENTURY_S)
    #: An Enqueued instance published this long ago and still unclaimed is published again.
    republish_after_s: float = Field(default=30.0, gt=0, le=CENTURY_S)
    #: Expired attempt leases are released only this long after the leader's duties start or
    #: resume after a store outage: workers whose heartbeats (and outcomes) failed during the
    #: outage renew (and record) first. At least the workers' heartbeat plus their retry backoff.
    reap_grace_s: float = Field(default=6.0, ge=0, le=CENTURY_S)
    #: An Enqueued instance of a job no live worker has registered (nor any worker for this
    #: long) is Terminated after this ("no worker knows the job").
    unknown_job_timeout_s: float = Field(default=3600.0, gt=0, le=CENTURY_S)
    #: A worker silent for this long is marked stopped.
    dead_worker_after_s: float = Field(default=30.0, gt=0, le=CENTURY_S)
    #: Terminal instances older than this are deleted (with their history); 0 keeps all.
    retention_days: float = Field(default=0, ge=0, le=CENTURY_S / 86_400)
    #: Debug: recurring jobs never fire by themselves (run them by hand).
    debug_no_auto_cron: bool = False
    #: Serve ``/healthz`` and ``/readyz`` on this port (0: no probe server).
    health_port: int = Field(default=0, ge=0, le=65535)
    #: The interface the probe server listens on.
    health_host: str = "0.0.0.0"

    def liveness_lease_s(self) -> float | None:
        return self.lease_ttl_s

    def session_name(self) -> str:
        return self.scheduler_id
