"""Typed settings, one object per role, read from ``JOBPLANE_*`` environment variables.

Built in ``main()`` (or a test), never at import time, and passed down explicitly.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from jobplane.logs import LogFormat

DEFAULT_DATABASE_URL = f"sqlite+aiosqlite:///{Path('jobplane.db').absolute()}"


@dataclass(frozen=True, slots=True)
class SessionLimits:
    """Per-session Postgres limits (see :meth:`CommonSettings.session_limits`)."""

    lock_timeout_s: float
    idle_in_transaction_timeout_s: float
    statement_timeout_s: float
    keepalive_s: float
    #: A connection attempt (TCP, TLS and start-up) that takes longer fails: an unreachable
    #: host that drops packets is an outage now, not after asyncpg's default 60 s.
    connect_timeout_s: float = 10.0


class CommonSettings(BaseSettings):
    """What every role needs: where the store and the bus are."""

    model_config = SettingsConfigDict(env_prefix="JOBPLANE_", extra="ignore")

    #: ``postgresql://…`` for production; a SQLite file by default (the embedded default).
    database_url: str = DEFAULT_DATABASE_URL
    #: ``redis://…`` for production; ``memory://`` is the in-process bus.
    redis_url: str = "memory://"
    #: Prefix of every Redis key (several deployments may share one Redis).
    key_prefix: str = Field(default="jobplane", pattern=r"^[A-Za-z0-9_.:\-]+$")
    log_level: str = "INFO"
    #: ``text`` for people, ``json`` (one object per line, with every structured field) for
    #: log collectors; the container image defaults to ``json``.
    log_format: LogFormat = LogFormat.TEXT
    #: Postgres connections each process keeps open (as many again are opened in bursts).
    db_pool_size: int = Field(default=10, ge=1, le=1000)
    #: Debug: instances triggered for triggered jobs are held (Scheduled with no due time)
    #: until someone runs them by hand (``POST /api/v1/instances/{id}/run``).
    debug_hold_triggered: bool = False
    #: Postgres session limits (0: sized from the role's lease, see :meth:`session_limits`).
    db_lock_timeout_s: float = Field(default=0, ge=0)
    db_idle_in_transaction_timeout_s: float = Field(default=0, ge=0)
    db_statement_timeout_s: float = Field(default=30.0, gt=0)
    db_connect_timeout_s: float = Field(default=10.0, gt=0)
    #: A role that starts while Postgres or Redis does not answer retries for this long
    #: (logging each try) before it exits 2; 0: one try. Start-up order then does not matter.
    startup_timeout_s: float = Field(default=60.0, ge=0)

    def liveness_lease_s(self) -> float | None:
        """The lease this role's liveness depends on (none for the api)."""
        return None

    def session_limits(self) -> SessionLimits:
        """Limits on every Postgres session of this role, so a paused or partitioned process
        never holds a lock that blocks a takeover: a transaction left idle (the process froze
        inside it) is ended by the server, a lock wait and a statement are bounded, and TCP
        keepalives find a vanished peer. Lock and idle limits default to half the role's
        lease (at most 2 s), so they end before the lease does."""
        lease = self.liveness_lease_s()
        default = min(2.0, lease / 2) if lease else 2.0
        return SessionLimits(
            lock_timeout_s=self.db_lock_timeout_s or default,
            idle_in_transaction_timeout_s=self.db_idle_in_transaction_timeout_s or default,
            statement_timeout_s=self.db_statement_timeout_s,
            keepalive_s=max(1.0, (lease or 20.0) / 2),
            connect_timeout_s=self.db_connect_timeout_s,
        )

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, value: str) -> str:
        return normalise_database_url(value)


class MigrateSettings(CommonSettings):
    """``jobplane migrate``: the schema, and an admin token that a deployment provisions."""

    #: A secret (``jp_`` and at least 32 more URL-safe characters, e.g. from
    #: ``python -c 'import secrets; print("jp_" + secrets.token_urlsafe(32))'``) that
    #: ``jobplane migrate`` makes sure is an admin token, so a fresh deployment can be used
    #: without a manual step. Stored hashed like any token; revoke it once other tokens exist
    #: (a revoked one is never restored).
    bootstrap_admin_token: SecretStr | None = None

    @field_validator("bootstrap_admin_token")
    @classmethod
    def _bootstrap_admin_token(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value():
            return None
        if not re.fullmatch(r"jp_[A-Za-z0-9_\-]{32,200}", value.get_secret_value()):
            raise ValueError("must be jp_ followed by at least 32 URL-safe characters")
        return value


def process_worker_id() -> str:
    """A worker id unique to this process: host, pid and a random suffix. Two workers on one
    host (or a pid reused after a restart) never share a consumer name or a worker row, so one
    stopping can never mark the other stopped or orphan its entries."""
    host = re.sub(r"[^A-Za-z0-9_.\-]", "-", socket.gethostname())[:100] or "worker"
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


class WorkerSettings(CommonSettings):
    #: Stable id (consumer name and lease holder). Set ``JOBPLANE_WORKER_ID`` (e.g. to a pod's
    #: name) to keep one across restarts; by default each process gets its own.
    worker_id: str = Field(default_factory=process_worker_id, pattern=r"^[A-Za-z0-9_.:\-]+$")
    queues: list[str] = ["default"]
    #: Jobs running at once in this worker (async and sync together).
    concurrency: int = Field(default=16, ge=1)
    #: Bus entries read per round trip.
    batch_size: int = Field(default=256, ge=1)
    #: How long a read blocks when the queues are empty (bounded so the worker can stop).
    poll_ms: int = Field(default=1000, ge=10)
    heartbeat_s: float = Field(default=2.0, gt=0)
    lease_s: float = Field(default=10.0, gt=0)
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


class DevSettings(WorkerSettings):
    """``jobplane dev``: every role in one process on the embedded default."""


def normalise_database_url(url: str) -> str:
    """Accept plain ``postgresql://`` and ``sqlite:///`` URLs and pick the async drivers."""
    for plain, driver in (
        ("postgresql://", "postgresql+asyncpg://"),
        ("postgres://", "postgresql+asyncpg://"),
        ("sqlite:///", "sqlite+aiosqlite:///"),
    ):
        if url.startswith(plain):
            return driver + url.removeprefix(plain)
    return url
