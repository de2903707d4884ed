"""Settings every role shares (:class:`CommonSettings`, read from ``JOBPLANE_*`` environment
variables); each role extends it with its own, in its service package.

Built in ``main()`` (or a test), never at import time, and passed down explicitly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote_plus, urlsplit

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from jobplane.logs import LogFormat

DEFAULT_DATABASE_URL = f"sqlite+aiosqlite:///{Path('jobplane.db').absolute()}"
#: The longest any duration setting may be (a century, in seconds): the leader subtracts them
#: from the database's time, and a larger one (``JOBPLANE_RETENTION_DAYS=1000000``) raised
#: OverflowError at its first housekeeping, which ended every scheduler that took the lease.
CENTURY_S = 100 * 365.25 * 86_400
#: The longest a Postgres session limit may be (a day; the server takes at most 24.8 days).
SESSION_LIMIT_MAX_S = 86_400.0


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
    #: The sessions' ``application_name`` (a scheduler's replica id: a standby taking over
    #: ends the sessions of the holder whose lease expired by it; operators see it too).
    application_name: str | None = None


class CommonSettings(BaseSettings):
    """What every role needs: where the store and the bus are."""

    # No infinite or NaN duration: JOBPLANE_LEASE_S=inf was accepted, and raised OverflowError
    # as the role sized its session limits.
    model_config = SettingsConfigDict(env_prefix="JOBPLANE_", extra="ignore", allow_inf_nan=False)

    #: ``postgresql://…`` for production; a SQLite file by default (the embedded default).
    database_url: str = DEFAULT_DATABASE_URL
    #: ``redis://…`` for production; ``memory://`` is the in-process bus.
    redis_url: str = "memory://"
    #: Prefix of every Redis key (several deployments may share one Redis).
    key_prefix: str = Field(default="jobplane", pattern=r"^[A-Za-z0-9_.:\-]+$")
    #: A level name of :mod:`logging` (``DEBUG``, ``INFO``, ``WARNING``…), in any case.
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
    db_lock_timeout_s: float = Field(default=0, ge=0, le=SESSION_LIMIT_MAX_S)
    db_idle_in_transaction_timeout_s: float = Field(default=0, ge=0, le=SESSION_LIMIT_MAX_S)
    #: (At least 10 ms: a shorter one ended statements before they could run, reported as
    #: conflicts retried for ever.)
    db_statement_timeout_s: float = Field(default=30.0, ge=0.01, le=SESSION_LIMIT_MAX_S)
    db_connect_timeout_s: float = Field(default=10.0, gt=0, le=SESSION_LIMIT_MAX_S)
    #: A role that starts while Postgres or Redis does not answer retries for this long
    #: (logging each try) before it exits 2; 0: one try. Start-up order then does not matter.
    startup_timeout_s: float = Field(default=60.0, ge=0, le=CENTURY_S)

    def liveness_lease_s(self) -> float | None:
        """The lease this role's liveness depends on (none for the api)."""
        return None

    def bus_read_timeout_s(self) -> float | None:
        """How long a Redis reply may take, when the role's blocking reads need longer than
        redis-py's 5 s (None: that)."""
        return None

    def session_name(self) -> str | None:
        """This process's id as the ``application_name`` of its Postgres sessions (a
        scheduler's replica id, a worker's id: what takes over from it ends its sessions
        still under way, ``store/postgres_sessions.py``); none for the api."""
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
            application_name=self.session_name(),
        )

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, value: str) -> str:
        names = [name for name in logging.getLevelNamesMapping() if name != "NOTSET"]
        if value.upper() not in names:
            raise ValueError(f"must be one of {', '.join(names)} (in any case)")
        return value.upper()

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, value: str) -> str:
        _check_host_and_port(value)
        return normalise_database_url(value)

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str) -> str:
        _check_host_and_port(value)
        return value


#: ``sslmode`` values (libpq's), which asyncpg's ``ssl`` takes as they are.
SSL_MODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")

#: Query parameters a ``postgresql://`` URL may carry: SQLAlchemy reads ``host`` (several
#: hosts, for a standby to take over) and ``prepared_statement_cache_size`` itself and hands
#: the rest to ``asyncpg.connect()`` as keywords, so anything else (libpq's
#: ``connect_timeout``, ``application_name``, ``sslrootcert``…) would fail every connection.
#: Timeouts and the session's name come from ``JOBPLANE_DB_*`` settings instead.
POSTGRES_URL_PARAMETERS = frozenset(
    {
        "ssl",
        "sslmode",
        "target_session_attrs",
        "krbsrvname",
        "gsslib",
        "passfile",
        "host",
        "prepared_statement_cache_size",
    }
)


def _check_host_and_port(url: str) -> None:
    """Refuse a URL whose host or port cannot be read (``host:notaport``, ``[::1`` unclosed):
    each raised ValueError from deep in a driver, a traceback. The message never repeats the
    URL (it may hold a password)."""
    try:
        urlsplit(url).port  # noqa: B018 (read for the check it makes)
    except ValueError as exc:
        raise ValueError(f"the URL's host or port cannot be read ({exc})") from None


def normalise_database_url(url: str) -> str:
    """Accept plain ``postgresql://`` and ``sqlite:///`` URLs and pick the async drivers. On
    Postgres, libpq's ``sslmode=`` (what managed providers hand out) becomes asyncpg's
    ``ssl=``; a parameter asyncpg does not take is refused (``ValueError``, naming it, never
    the URL: it may hold a password)."""
    for plain, driver in (
        ("postgresql://", "postgresql+asyncpg://"),
        ("postgres://", "postgresql+asyncpg://"),
        ("sqlite:///", "sqlite+aiosqlite:///"),
    ):
        if url.startswith(plain):
            url = driver + url.removeprefix(plain)
            break
    if url.startswith("postgresql+asyncpg://"):
        return _asyncpg_query(url)
    return url


def _asyncpg_query(url: str) -> str:
    """``url`` with ``sslmode`` renamed ``ssl``; other parameters are left byte for byte."""
    base, sep, query = url.partition("?")
    if not sep:
        return url
    parts = [part for part in query.split("&") if part]
    names = [unquote_plus(part.partition("=")[0]) for part in parts]
    unknown = sorted({name for name in names if name not in POSTGRES_URL_PARAMETERS})
    if unknown:
        raise ValueError(
            f"unsupported parameter(s) in the URL: {', '.join(unknown)} (accepted: "
            f"{', '.join(sorted(POSTGRES_URL_PARAMETERS))}; timeouts and the session name "
            "are JOBPLANE_DB_* settings)"
        )
    if names.count("ssl") + names.count("sslmode") > 1:
        raise ValueError("give sslmode (or ssl) once in the URL")
    rewritten = []
    for part, name in zip(parts, names, strict=True):
        if name in ("ssl", "sslmode"):
            mode = unquote_plus(part.partition("=")[2])
            if mode not in SSL_MODES:
                raise ValueError(f"{name} in the URL must be one of: {', '.join(SSL_MODES)}")
            part = f"ssl={mode}"
        rewritten.append(part)
    return f"{base}?{'&'.join(rewritten)}"
