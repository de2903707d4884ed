"""Frozen domain objects exchanged with the store and the bus (not ORM rows, not API schemas)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime
from enum import StrEnum
from typing import Any
from uuid import UUID

from jobplane.domain.frozen import quick_init
from jobplane.domain.options import JobOptions
from jobplane.domain.states import CANCEL_STATES, InstanceState
from jobplane.ids import new_id

JSON = Any  # a value json.dumps accepts


class InstanceSource(StrEnum):
    CRON = "cron"  # a tick of a recurring job: unique on (job key, scheduled time)
    TRIGGER = "trigger"  # code, REST, CLI or dashboard
    RETRY = "retry"  # a new instance for a terminal one (``retry_of``)


@dataclass(frozen=True, slots=True)
class JobDefinition:
    """A stored job definition: options plus the bookkeeping the store keeps."""

    options: JobOptions
    version: int
    paused: bool = False
    args_schema: dict[str, Any] | None = None
    created_at: datetime | None = None
    updated_at: datetime | None = None
    updated_by: str | None = None
    #: When the schedule (cron, time zone, start_at) was last edited; ticks of the current
    #: schedule before it never existed.
    schedule_since: datetime | None = None
    #: The name of the App whose worker last registered the job; None if none has since
    #: the store began recording it.
    app: str | None = None

    @property
    def key(self) -> str:
        return self.options.key


class DefinitionChange(StrEnum):
    """What made a new version of a definition."""

    REGISTER = "register"  # first registration, from code
    EDIT = "edit"
    PAUSE = "pause"
    RESUME = "resume"
    ROLLBACK = "rollback"  # options copied from an older version
    IMPORT = "import"  # the version a definition had when its history began


@dataclass(frozen=True, slots=True)
class DefinitionVersion:
    """One saved version of a definition: the full options as they were then."""

    key: str
    version: int
    options: JobOptions
    paused: bool
    action: DefinitionChange
    actor: str
    at: datetime
    rolled_back_to: int | None = None


@dataclass(frozen=True, slots=True)
class JobSummary:
    """How a job has been doing: its latest outcome and its recent runs.

    ``succeeded`` and ``ended`` count the instances that reached a terminal state within the
    window; ``p95_duration_s`` is over the attempts (claim to end) that ended within it.
    """

    key: str
    last_state: InstanceState | None = None
    last_ended_at: datetime | None = None
    succeeded: int = 0
    ended: int = 0
    p95_duration_s: float | None = None

    @property
    def success_rate(self) -> float | None:
        return self.succeeded / self.ended if self.ended else None


@dataclass(frozen=True, slots=True)
class Bucket:
    """Ends recorded in one time bucket ``[start, start + width)``: attempts that succeeded,
    attempts that failed, instances that were terminated (no attempts left, worker lost)."""

    start: datetime
    succeeded: int = 0
    failed: int = 0
    terminated: int = 0


@dataclass(frozen=True, slots=True)
class NewInstance:
    """What a trigger or a cron fire asks the store to create.

    The initial state follows: ``skip_reason`` → Skipped (a misfire recorded); ``held`` →
    Scheduled with no due time; ``run_at`` later than the database's clock → Scheduled;
    otherwise Enqueued.
    """

    job_key: str
    args: JSON = None
    source: InstanceSource = InstanceSource.TRIGGER
    run_at: datetime | None = None
    held: bool = False
    scheduled_at: datetime | None = None
    priority: int | None = None
    queue: str | None = None
    pinned_worker: str | None = None
    retry_of: UUID | None = None
    idempotency_key: str | None = None
    #: The request's fingerprint (see :mod:`jobplane.idempotency`); computed from the fields
    #: above when not given. Only kept with an ``idempotency_key``.
    fingerprint: str | None = None
    skip_reason: str | None = None
    actor: str = "system"
    id: UUID = field(default_factory=new_id)


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    type: str
    message: str
    traceback: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"type": self.type, "message": self.message, "traceback": self.traceback}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ErrorInfo:
        return cls(type=data["type"], message=data["message"], traceback=data.get("traceback"))


@quick_init  # made by the thousand (claims, bulk triggers, cron ticks): see domain.frozen
@dataclass(frozen=True, slots=True)
class Instance:
    id: UUID
    job_key: str
    state: InstanceState
    source: InstanceSource
    queue: str
    priority: int
    args: JSON
    created_at: datetime
    scheduled_at: datetime | None = None
    run_at: datetime | None = None
    published_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    attempt: int = 0
    retries_used: int = 0
    unexpected_retries_used: int = 0
    claim_token: int | None = None
    worker_id: str | None = None
    lease_expires_at: datetime | None = None
    cancel_requested: bool = False
    pinned_worker: str | None = None
    retry_of: UUID | None = None
    idempotency_key: str | None = None
    progress: float | None = None
    progress_message: str | None = None
    checkpoint: JSON = None
    result: JSON = None
    error: ErrorInfo | None = None
    reason: str | None = None
    idempotency_fingerprint: str | None = None


@dataclass(frozen=True, slots=True)
class Transition:
    """One history record: an instance moved ``from_state → to_state`` (``None`` = created)."""

    seq: int
    instance_id: UUID
    from_state: InstanceState | None
    to_state: InstanceState
    at: datetime
    actor: str
    reason: str | None = None
    claim_token: int | None = None


@dataclass(frozen=True, slots=True)
class Claim:
    """A won claim: the instance (with its fresh claim token) and the options that apply now."""

    instance: Instance
    options: JobOptions

    @property
    def token(self) -> int:
        assert self.instance.claim_token is not None
        return self.instance.claim_token


class ClaimOutcome(StrEnum):
    """What a claim did to one instance it was given and could act on (see
    :class:`ClaimResult`); the Postgres claim statement names each row's with its value."""

    CLAIMED = "claimed"
    SKIPPED = "skipped"
    WAITING = "waiting"
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class ClaimResult:
    """What one batch claim did to each instance id it was given.

    - ``claimed``: now Processing for this worker, slot taken.
    - ``skipped``: job at max concurrency with ``on_limit=skip``; now Skipped.
    - ``waiting``: job at max concurrency with ``on_limit=wait``; still Enqueued, unpublished.
    - ``cancelled``: a cancel was requested for it (``cancel_requested``); now Cancelled.
    - ``ignored``: not claimable here (no longer Enqueued, pinned elsewhere, unknown id).
    """

    claimed: list[Claim] = field(default_factory=list)
    skipped: list[UUID] = field(default_factory=list)
    waiting: list[UUID] = field(default_factory=list)
    cancelled: list[UUID] = field(default_factory=list)
    ignored: list[UUID] = field(default_factory=list)


@quick_init  # one per attempt recorded (see jobplane.domain.frozen)
@dataclass(frozen=True, slots=True)
class Outcome:
    """The end of one attempt, reported by the worker holding ``claim_token``.

    ``state`` is Succeeded, Failed or Cancelled. For Failed, ``retry_delay_s`` is the backoff
    the worker computed; the store retries only while the job has attempts left.
    ``holds_slot``: the attempt's code still runs (a sync job past its timeout): the outcome is
    recorded but the job's concurrency slot stays held until the worker releases it.
    """

    instance_id: UUID
    claim_token: int
    state: InstanceState
    result: JSON = None
    error: ErrorInfo | None = None
    reason: str | None = None
    retry_delay_s: float = 0.0
    holds_slot: bool = False


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    id: str
    host: str
    pid: int
    queues: tuple[str, ...]
    capacity: int
    version: str
    jobs: tuple[str, ...] = ()
    started_at: datetime | None = None
    heartbeat_at: datetime | None = None
    stopped_at: datetime | None = None

    def runs(self, definition: JobDefinition) -> bool:
        """Whether this worker can run the job now: live, it registered the job and consumes
        the job's stored queue (an edit may have moved it). A worker that knows the job but
        consumes other queues never claims its instances (one pool's job on another pool)."""
        return (
            self.stopped_at is None
            and definition.key in self.jobs
            and definition.options.queue in self.queues
        )


@dataclass(frozen=True, slots=True)
class LeaderLease:
    shard: int
    holder: str
    term: int
    acquired_at: datetime
    expires_at: datetime


@dataclass(frozen=True, slots=True)
class Lags:
    """How late work started over a recent window: cron ticks fired after their scheduled
    time (created - scheduled), and instances claimed after they were enqueued (Enqueued →
    Processing). ``None`` percentiles: nothing of that kind in the window."""

    fire_p95_s: float | None = None
    fires: int = 0
    pickup_p95_s: float | None = None
    pickups: int = 0


@dataclass(frozen=True, slots=True)
class SchedulerReplica:
    """A scheduler replica as it last campaigned for its shard's lease (leader or standby)."""

    shard: int
    holder: str
    started_at: datetime
    seen_at: datetime


@dataclass(frozen=True, slots=True)
class RunawaySlot:
    """A concurrency slot still held by an attempt's code after its outcome was recorded (a
    sync job that ignored its timeout), until the code returns or its worker goes away."""

    instance_id: UUID
    claim_token: int
    job_key: str
    worker_id: str
    held_since: datetime


@dataclass(frozen=True, slots=True)
class InstanceFilter:
    """Filters for :meth:`Store.list_instances`; every field is optional (AND-ed)."""

    job_key: str | None = None
    #: Only these jobs' instances (an App's jobs); None: any job, empty: none.
    job_keys: tuple[str, ...] | None = None
    states: tuple[InstanceState, ...] = ()
    created_after: datetime | None = None
    created_before: datetime | None = None
    scheduled_after: datetime | None = None
    scheduled_before: datetime | None = None
    worker_id: str | None = None
    #: Only instances no bulk retry has retried yet (none holds the key
    #: :func:`~jobplane.domain.limits.bulk_retry_key` of it).
    unretried: bool = False
    #: Only instances a cancel changes: queued ones, and running ones not yet told to stop.
    cancellable: bool = False

    # What the bulk actions select. Each selects only what it changes: an instance it cannot
    # change, selected again at every call, kept the ones after it out of reach while the
    # answer's ``more`` said to call again.

    def for_cancel(self) -> InstanceFilter | None:
        """What a bulk cancel selects of this filter (``None``: nothing): queued instances,
        and running ones not yet told to stop (they stay running until their worker stops),
        in this filter's states (all of those if it names none)."""
        states = tuple(s for s in self.states or CANCEL_STATES if s in CANCEL_STATES)
        return replace(self, states=states, cancellable=True) if states else None

    def for_retry(self) -> InstanceFilter | None:
        """What a bulk retry selects of this filter (``None``: nothing): ended instances no
        bulk retry has retried yet, in this filter's states (Terminated if it names none)."""
        states = tuple(s for s in self.states or (InstanceState.TERMINATED,) if s.is_terminal)
        return replace(self, states=states, unretried=True) if states else None


@dataclass(frozen=True, slots=True)
class Page:
    """One page of a keyset-paginated listing; pass ``next_cursor`` to get the next one."""

    items: list[Instance]
    next_cursor: UUID | None


@dataclass(frozen=True, slots=True)
class BulkCancel:
    """What one bulk cancel did to the instances it examined (oldest first, up to its limit;
    each list in id order).

    - ``cancelled``: were Scheduled or Enqueued; now Cancelled.
    - ``requested``: were Processing (or Failed); ``cancel_requested`` is set for the worker.
    - ``skipped``: in a state a cancel cannot leave (terminal), or moved on meanwhile.
    - ``more``: more instances match the filter than were examined.
    """

    cancelled: list[Instance] = field(default_factory=list)
    requested: list[Instance] = field(default_factory=list)
    skipped: list[UUID] = field(default_factory=list)
    more: bool = False


@dataclass(frozen=True, slots=True)
class BulkRetry:
    """What one bulk retry did (newest first, up to its limit).

    - ``retried``: (instance id, its new instance) pairs.
    - ``skipped``: selected but not retried: its job disabled or gone, its arguments no longer
      valid for the job, or retried meanwhile by another bulk retry.
    - ``next_cursor``: more instances match than were examined; passed back as ``before``, the
      next call goes on past those skipped for good. (Without it the next call starts from the
      newest again, which is already past those retried: a bulk retry selects only instances
      no bulk retry has retried.)
    """

    retried: list[tuple[UUID, Instance]] = field(default_factory=list)
    skipped: list[UUID] = field(default_factory=list)
    next_cursor: UUID | None = None

    @property
    def more(self) -> bool:
        return self.next_cursor is not None
