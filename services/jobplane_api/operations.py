"""API schemas of the operator's view: workers, the scheduler, stats, and the bulk cancel and
retry (re-exported by ``jobplane_api.schemas``, where the routers import them)."""

from __future__ import annotations

from datetime import datetime
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field

from jobplane.domain.models import Bucket, BulkCancel, BulkRetry, InstanceFilter, WorkerInfo
from jobplane.domain.states import InstanceState
from jobplane_api.inputs import FilterTime, ShortText


class WorkerOut(BaseModel):
    id: str
    host: str
    pid: int
    queues: list[str]
    jobs: list[str]
    capacity: int
    version: str
    started_at: datetime | None
    heartbeat_at: datetime | None
    stopped_at: datetime | None
    running: list[UUID] = Field(default_factory=list, description="Instances it runs now.")

    @classmethod
    def of(cls, w: WorkerInfo, running: list[UUID]) -> WorkerOut:
        return cls(
            id=w.id,
            host=w.host,
            pid=w.pid,
            queues=list(w.queues),
            jobs=list(w.jobs),
            capacity=w.capacity,
            version=w.version,
            started_at=w.started_at,
            heartbeat_at=w.heartbeat_at,
            stopped_at=w.stopped_at,
            running=running,
        )


class SchedulerOut(BaseModel):
    leader: str | None
    term: int | None
    since: datetime | None
    expires_at: datetime | None


class BucketOut(BaseModel):
    start: datetime = Field(description="Start of the bucket (UTC).")
    succeeded: int = Field(description="Attempts that succeeded.")
    failed: int = Field(description="Attempts that failed (a retry may follow).")
    terminated: int = Field(description="Instances terminated (no attempts left, worker lost).")

    @classmethod
    def of(cls, b: Bucket) -> BucketOut:
        return cls(start=b.start, succeeded=b.succeeded, failed=b.failed, terminated=b.terminated)


class StatsOut(BaseModel):
    by_state: dict[InstanceState, int]
    per_minute: list[BucketOut] = Field(
        default_factory=list, description="The last hour, one bucket a minute, oldest first."
    )
    per_hour: list[BucketOut] = Field(
        default_factory=list, description="The last day, one bucket an hour, oldest first."
    )


#: How the time filters read their values.
TIME_FILTER = (
    "ISO 8601; with a UTC offset, or without one and then UTC (`2026-01-01` is midnight UTC)."
)

#: The most instances one bulk cancel or retry examines.
BULK_LIMIT_MAX = 10_000


class BulkFilterIn(BaseModel):
    """The instances to act on: the filters of the instance list, AND-ed, and a bound."""

    model_config = ConfigDict(extra="forbid")

    job: ShortText | None = Field(default=None, description="Job key.")
    states: list[InstanceState] | None = Field(
        default=None,
        description="States to select; omitted: every state the operation applies to.",
    )
    created_after: FilterTime | None = Field(default=None, description=TIME_FILTER)
    created_before: FilterTime | None = None
    scheduled_after: FilterTime | None = Field(default=None, description="Cron tick from.")
    scheduled_before: FilterTime | None = None
    worker: ShortText | None = Field(default=None, description="Worker id.")
    limit: int = Field(
        default=1000, ge=1, le=BULK_LIMIT_MAX, description="At most this many instances."
    )

    def to_filter(self, default_states: tuple[InstanceState, ...]) -> InstanceFilter:
        return InstanceFilter(
            job_key=self.job,
            states=tuple(self.states) if self.states else default_states,
            created_after=self.created_after,
            created_before=self.created_before,
            scheduled_after=self.scheduled_after,
            scheduled_before=self.scheduled_before,
            worker_id=self.worker,
        )


class BulkCancelOut(BaseModel):
    cancelled: int = Field(description="Scheduled or Enqueued instances now Cancelled.")
    cancel_requested: int = Field(description="Running instances told to stop.")
    skipped: int = Field(
        description="Selected, but moved on before the cancel reached them. A cancel selects "
        "only what it can change: queued instances and running ones not yet told to stop."
    )
    more: bool = Field(
        description="More instances match than `limit`: call again (the ones changed now are "
        "no longer selected)."
    )
    cancelled_ids: list[UUID]
    cancel_requested_ids: list[UUID]
    skipped_ids: list[UUID]

    @classmethod
    def of(cls, done: BulkCancel) -> BulkCancelOut:
        return cls(
            cancelled=len(done.cancelled),
            cancel_requested=len(done.requested),
            skipped=len(done.skipped),
            more=done.more,
            cancelled_ids=[i.id for i in done.cancelled],
            cancel_requested_ids=[i.id for i in done.requested],
            skipped_ids=done.skipped,
        )


class RetryPairOut(BaseModel):
    instance_id: UUID = Field(description="The instance retried.")
    retry_id: UUID = Field(description="The new instance (its `retry_of` is `instance_id`).")


class BulkRetryIn(BulkFilterIn):
    """A bulk retry's selection: the filters, the bound, and where the last call ended."""

    before: UUID | None = Field(
        default=None,
        description="`next_cursor` of the previous call: go on with the instances older than "
        "the ones it examined.",
    )


class BulkRetryOut(BaseModel):
    retried: int = Field(description="New instances created.")
    skipped: int = Field(
        description="Selected, but of a disabled or unknown job, with arguments the job no "
        "longer accepts, or retried meanwhile by another bulk retry."
    )
    more: bool = Field(
        description="More instances match than `limit`: call again. The ones retried now are "
        "no longer selected; pass `next_cursor` as `before` to go on past those skipped."
    )
    next_cursor: UUID | None = Field(
        description="Where this call ended (with `more`); `null` when nothing more matched."
    )
    retries: list[RetryPairOut]
    skipped_ids: list[UUID]

    @classmethod
    def of(cls, done: BulkRetry) -> BulkRetryOut:
        return cls(
            retried=len(done.retried),
            skipped=len(done.skipped),
            more=done.more,
            next_cursor=done.next_cursor,
            retries=[RetryPairOut(instance_id=old, retry_id=new.id) for old, new in done.retried],
            skipped_ids=done.skipped,
        )
