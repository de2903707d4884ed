"""Settings of the worker role (``JOBPLANE_*`` environment variables)."""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
from typing import Annotated, Any, Self

from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode

from jobplane.domain.options import QUEUE_PATTERN
from jobplane.settings import CENTURY_S, CommonSettings


def process_worker_id() -> str:
    """A worker id unique to this process: host, pid and a random suffix. Two workers on one
    host (or a pid reused after a restart) never share a consumer name or a worker row, so one
    stopping can never mark the other stopped or orphan its entries."""
    host = re.sub(r"[^A-Za-z0-9_.\-]", "-", socket.gethostname())[:100] or "worker"
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


class WorkerSettings(CommonSettings):
    """A worker: the queues it consumes, how much it runs at once, its lease and its probes."""

    #: Stable id (consumer name and lease holder). Set ``JOBPLANE_WORKER_ID`` (e.g. to a pod's
    #: name) to keep one across restarts; by default each process gets its own.
    worker_id: str = Field(default_factory=process_worker_id, pattern=r"^[A-Za-z0-9_.:\-]+$")
    #: ``JOBPLANE_QUEUES``: comma-separated (``default,mail``, as ``--queues`` takes them) or a
    #: JSON list (``["default", "mail"]``).
    queues: Annotated[list[str], NoDecode] = ["default"]
    #: Jobs running at once in this worker (async and sync together).
    concurrency: int = Field(default=16, ge=1, le=100_000)
    #: Bus entries read per round trip.
    batch_size: int = Field(default=256, ge=1, le=100_000)
    #: How long a read blocks when the queues are empty (bounded so the worker can stop; the
    #: Redis client waits this long and 5 s more for a reply, see bus_read_timeout_s).
    poll_ms: int = Field(default=1000, ge=10, le=60_000)
    #: Every attempt's lease is renewed (and the worker's row refreshed) this often: under
    #: half the lease (an attempt is stopped up to half a lease before its lease ends), and at
    #: most 10 s (the leader takes a worker silent for ``JOBPLANE_DEAD_WORKER_AFTER_S``, 30 s
    #: by default, for dead).
    heartbeat_s: float = Field(default=2.0, gt=0, le=10)
    #: (At least 0.1 s: a lease of a millisecond ended every transaction it bounds at once.)
    lease_s: float = Field(default=10.0, ge=0.1, le=CENTURY_S)
    #: Entries delivered to a consumer that went silent are reclaimed after this idle time.
    reclaim_idle_s: float = Field(default=30.0, gt=0)
    #: An entry for a job this worker does not know is put back after this delay.
    unknown_job_delay_s: float = Field(default=1.0, ge=0)
    #: Seconds running jobs get to finish on SIGTERM before they are released.
    grace_s: float = Field(default=30.0, ge=0)
    #: After a job's timeout its cancellation is signalled; this long later an async job is
    #: cancelled outright, and a sync job still running is reported as a runaway (it keeps its
    #: thread and slot until its code returns).
    timeout_grace_s: float = Field(default=5.0, ge=0)
    #: Serve ``/healthz``, ``/readyz`` and ``/metrics`` on this port (0: no probe server).
    health_port: int = Field(default=0, ge=0, le=65535)
    #: The interface the probe server listens on.
    health_host: str = "0.0.0.0"

    def liveness_lease_s(self) -> float | None:
        return self.lease_s

    def bus_read_timeout_s(self) -> float:
        # A read blocks up to poll_ms: against redis-py's 5 s read timeout, a longer block
        # (JOBPLANE_POLL_MS=10000) was a Redis outage logged every poll.
        return self.poll_ms / 1000 + 5.0

    @model_validator(mode="after")
    def _renewed_in_time(self) -> Self:
        # Accepted, a heartbeat of 3 s against a lease of 5 s stopped every attempt longer
        # than about 2.5 s at its fence, before a renewal came: each ended Terminated.
        if self.heartbeat_s >= self.lease_s / 2:
            raise ValueError(
                f"JOBPLANE_HEARTBEAT_S ({self.heartbeat_s:g}) must be under half of "
                f"JOBPLANE_LEASE_S ({self.lease_s:g}): leases are renewed every heartbeat, and "
                "an attempt stops up to half a lease before its lease ends"
            )
        return self

    def session_name(self) -> str:
        return self.worker_id

    @field_validator("queues", mode="before")
    @classmethod
    def _queues(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                try:
                    value = json.loads(text)
                except json.JSONDecodeError:
                    raise ValueError("a JSON list of queue names is not valid JSON") from None
            else:
                value = [name.strip() for name in text.split(",") if name.strip()]
        if isinstance(value, list) and not value:
            raise ValueError("name at least one queue")
        return value

    @field_validator("queues")
    @classmethod
    def _queue_names(cls, value: list[str]) -> list[str]:
        bad = [name for name in value if not QUEUE_PATTERN.fullmatch(name)]
        if bad:
            raise ValueError(
                f"not a queue name: {', '.join(map(repr, bad))} (lower-case letters, digits, "
                "_ . -; comma-separated or a JSON list)"
            )
        return value
