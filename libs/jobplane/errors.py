"""The exception hierarchy: every error Jobplane raises derives from :class:`JobplaneError`.

Driver errors (asyncpg, sqlite3, redis) are translated at the store and bus boundaries with
``raise ... from exc`` so callers only ever catch these.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any
from uuid import UUID


def first_line(exc: BaseException) -> str:
    """The first line of an error's message (a driver's own error when SQLAlchemy wraps it),
    without NUL characters (Postgres text cannot hold them), or its type's name if it has no
    message: for log lines and for errors stored with an instance."""
    text = str(getattr(exc, "orig", None) or exc).replace("\x00", "")
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__


class JobplaneError(Exception):
    """Root of every error raised by Jobplane."""


class ConfigurationError(JobplaneError):
    """A setting is missing or malformed; raised at start, before anything runs."""


class StoppedWhileStarting(JobplaneError):
    """The role was told to stop while a startup hook ran (the hook was cancelled)."""


class StartupHookError(ConfigurationError):
    """A startup hook of the App raised (its traceback is logged, and chained)."""


class SchemaBehindError(ConfigurationError):
    """The database schema is older than this version needs (``jobplane migrate`` has not
    run yet, or is running): a starting role waits for it like for an unreachable store."""


class InvalidOptionsError(JobplaneError, ValueError):
    """A job option is invalid. ``field`` names the option, ``reason`` says why; ``item`` is
    the position of the request it is about in a batch (``Dispatcher.trigger_many``)."""

    item: int | None = None

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class IllegalTransitionError(JobplaneError):
    """A state change that the state machine does not allow (e.g. Succeeded → Enqueued)."""

    def __init__(self, from_state: object, to_state: object) -> None:
        super().__init__(f"illegal transition {from_state} → {to_state}")
        self.from_state = from_state
        self.to_state = to_state


class JobNotFoundError(JobplaneError, LookupError):
    """No job definition with this key."""

    def __init__(self, key: str) -> None:
        super().__init__(f"no job with key {key!r}")
        self.key = key


class StaleDefinitionError(JobplaneError):
    """The job's definition is no longer the one a caller validated against (edited, its
    argument schema replaced, or deleted): nothing was written. Read it again and decide
    again."""

    def __init__(self, key: str, version: int) -> None:
        super().__init__(f"job {key!r} changed since version {version} was read")
        self.key = key
        self.version = version


class DefinitionsChangedError(JobplaneError):
    """Jobs whose stored definition is no longer the version the caller planned their ticks
    under (edited, paused, resumed, disabled since): nothing was written. Read them again and
    plan again."""

    def __init__(self, keys: Iterable[str]) -> None:
        self.keys = frozenset(keys)
        super().__init__(f"jobs changed since they were planned: {', '.join(sorted(self.keys))}")


class DefinitionVersionNotFoundError(JobplaneError, LookupError):
    """A job has no saved version with this number."""

    def __init__(self, key: str, version: int) -> None:
        super().__init__(f"job {key!r} has no version {version}")
        self.key = key
        self.version = version


class InstanceNotFoundError(JobplaneError, LookupError):
    """No job instance with this id."""

    def __init__(self, instance_id: UUID) -> None:
        super().__init__(f"no instance with id {instance_id}")
        self.instance_id = instance_id


class UnavailableError(JobplaneError):
    """A backing service (database, Redis) cannot be reached."""


class StoreUnavailableError(UnavailableError):
    """The metadata store cannot be reached or refused the connection."""


class BusUnavailableError(UnavailableError):
    """The message bus cannot be reached."""


class WorkerEvictedError(JobplaneError):
    """This worker was marked stopped while it still ran (paused or cut off for longer than
    the scheduler's dead-worker threshold): its attempts were reaped and its slots given back,
    so it must stop at once rather than run on beside their new owners."""


class WorkerFailedError(JobplaneError):
    """This worker failed (a part of it died: its heartbeat, its recorder, its probe server)
    while job code still ran in it. Nothing stops that code but the end of the process, so
    the process must end at once; its attempts are left to their leases and its slots to the
    dead-worker sweep, as after a kill. (Marked stopped while the code ran, its rows and slots
    went to other workers beside it.)"""


class EnvelopeError(JobplaneError, ValueError):
    """A bus entry could not be decoded into an :class:`~jobplane.bus.envelope.Envelope`."""


class IdempotencyConflictError(JobplaneError):
    """An idempotency key was used before for a different request (another job, other
    arguments, time, priority or pinned worker): nothing was created."""

    def __init__(self, key: str) -> None:
        super().__init__(f"Idempotency-Key {key!r} was used before with a different request")
        self.key = key


class LastAdminError(JobplaneError):
    """Revoking this token would leave no live admin token: refused, since only database
    access could then mint a new one."""

    def __init__(self, token_id: UUID) -> None:
        super().__init__(f"token {token_id} is the last live admin token; create another first")
        self.token_id = token_id


class NotLeaderError(JobplaneError):
    """The lease of this term is no longer live: a leader write was refused."""


class StoreConflictError(StoreUnavailableError):
    """A transaction lost to a concurrent one (deadlock, serialization failure, lock wait
    timeout) and was rolled back: nothing of it was written, and trying again is safe. The
    store retries these itself (:func:`retry_conflicts`); one that still fails is reported as
    a short outage, which every role waits out."""


class StoreRefusedError(JobplaneError):
    """The database refused a statement for what it was given or holds (a constraint, a
    value it cannot store: a poison row), neither an outage nor a conflict: trying the same
    again fails again. ``sqlstate`` is its SQLSTATE (class 22: a value out of range or
    untranslatable; 23: a constraint), empty when the driver gave none; the driver's error is
    the ``__cause__``."""

    def __init__(self, message: str, sqlstate: str) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


class JobDisabledError(JobplaneError):
    """The job is disabled: it takes no new instances."""

    def __init__(self, key: str) -> None:
        super().__init__(f"job {key!r} is disabled")
        self.key = key


class InvalidArgumentsError(InvalidOptionsError):
    """Trigger arguments do not match the job's JSON Schema; ``field`` is the JSON path."""


class LeaseLostError(JobplaneError):
    """This attempt no longer holds its instance (lease expired, re-claimed): its writes are
    refused. The job should stop; its outcome will not be recorded."""


class CheckpointNotSavedError(StoreUnavailableError):
    """The store stayed unreachable while :meth:`JobContext.checkpoint` retried, until this
    attempt's lease could have expired: the checkpoint was not saved."""


class ApiError(JobplaneError):
    """The API answered with an error (problem+json)."""

    def __init__(self, status: int, problem: Mapping[str, Any]) -> None:
        detail = problem.get("detail") or problem.get("title") or "error"
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status
        self.problem = dict(problem)
