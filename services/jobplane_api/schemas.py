"""API schemas: what crosses the HTTP boundary (never ORM rows, never domain objects)."""

from __future__ import annotations

from datetime import datetime
from typing import Any
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field, field_validator

from jobplane.domain.attempts import Attempt, attempts_of
from jobplane.domain.limits import MAX_RESULT_BYTES, check_json
from jobplane.domain.models import (
    DefinitionChange,
    DefinitionVersion,
    Instance,
    JobDefinition,
    JobSummary,
    Transition,
)
from jobplane.domain.options import PRIORITY_MAX, PRIORITY_MIN, JobOptions, not_a_bool
from jobplane.domain.states import InstanceState
from jobplane.errors import InvalidOptionsError
from jobplane_api.inputs import Args, DueTime, IdempotencyKey, ShortText

# Re-exported (explicitly): the routers import every schema from here.
from jobplane_api.operations import BULK_LIMIT_MAX as BULK_LIMIT_MAX
from jobplane_api.operations import TIME_FILTER as TIME_FILTER
from jobplane_api.operations import BucketOut as BucketOut
from jobplane_api.operations import BulkCancelOut as BulkCancelOut
from jobplane_api.operations import BulkFilterIn as BulkFilterIn
from jobplane_api.operations import BulkRetryIn as BulkRetryIn
from jobplane_api.operations import BulkRetryOut as BulkRetryOut
from jobplane_api.operations import RetryPairOut as RetryPairOut
from jobplane_api.operations import SchedulerOut as SchedulerOut
from jobplane_api.operations import StatsOut as StatsOut
from jobplane_api.operations import WorkerOut as WorkerOut

# Re-exported (explicitly): the routers document their answers with these.
from jobplane_api.responses import INSTANCE_LINKS as INSTANCE_LINKS
from jobplane_api.responses import JOB_LIST_LINKS as JOB_LIST_LINKS
from jobplane_api.responses import PROBLEM_RESPONSES as PROBLEM_RESPONSES
from jobplane_api.responses import Problem as Problem

#: Values larger than this (encoded JSON bytes) are left out of instance lists.
LIST_VALUE_MAX = 1024

#: Versions are stored as 32-bit integers.
VERSION_MAX = 2**31 - 1

#: Ten years: a longer delay is a mistake, not a schedule.
MAX_DELAY_S = 10 * 365 * 24 * 3600


class OutcomeOut(BaseModel):
    state: InstanceState
    ended_at: datetime


class JobOut(BaseModel):
    key: str
    version: int
    paused: bool
    options: JobOptions
    args_schema: dict[str, Any] | None
    app: str | None = Field(
        default=None,
        description="The name of the App whose worker last registered the job; null when no "
        "worker has registered it since the store began recording it.",
    )
    updated_at: datetime | None
    updated_by: str | None
    next_fire: datetime | None = Field(
        default=None, description="Next fire time of a recurring job (UTC), if it fires."
    )
    next_fire_times: list[datetime] = Field(
        default_factory=list,
        description="Next fire times of a recurring job (UTC), within its start_at/end_at "
        "window: empty once end_at has passed.",
    )
    schedule_error: str | None = Field(
        default=None,
        description="Why the next fire times of this recurring job cannot be computed (its "
        "stored cron expression can never fire, e.g. one saved before such expressions were "
        "refused, or a start_at with no tick before the year 10000); the scheduler does not "
        "fire it until it is edited. Null when it is fine.",
    )
    last_outcome: OutcomeOut | None = Field(
        default=None, description="State and end time of the latest instance that ended."
    )
    success_rate_24h: float | None = Field(
        default=None,
        description="Succeeded / ended among the instances that ended (any terminal state) "
        "in the last 24 h; null when none did.",
    )
    p95_duration_s_24h: float | None = Field(
        default=None,
        description="95th percentile of attempt duration (claim to end, seconds) of the "
        "attempts that ended in the last 24 h; null when none did.",
    )
    runners: int = Field(
        default=0,
        description="Live workers that registered the job and consume its queue. While it is "
        "0 the job's instances wait on the queue: a worker that knows the job but consumes "
        "other queues never runs them. When no live worker has registered the job at all for "
        "JOBPLANE_UNKNOWN_JOB_TIMEOUT_S, the leader ends its waiting instances Terminated.",
    )

    @classmethod
    def of(
        cls,
        definition: JobDefinition,
        next_fires: list[datetime] | None = None,
        summary: JobSummary | None = None,
        schedule_error: str | None = None,
        runners: int = 0,
    ) -> JobOut:
        summary = summary or JobSummary(key=definition.key)
        last = None
        if summary.last_state is not None and summary.last_ended_at is not None:
            last = OutcomeOut(state=summary.last_state, ended_at=summary.last_ended_at)
        return cls(
            key=definition.key,
            version=definition.version,
            paused=definition.paused,
            options=definition.options,
            args_schema=definition.args_schema,
            app=definition.app,
            updated_at=definition.updated_at,
            updated_by=definition.updated_by,
            next_fire=next_fires[0] if next_fires else None,
            next_fire_times=next_fires or [],
            schedule_error=schedule_error,
            last_outcome=last,
            success_rate_24h=summary.success_rate,
            p95_duration_s_24h=summary.p95_duration_s,
            runners=runners,
        )


class JobPatch(BaseModel):
    """Options to change; ``version`` must be the version you read (optimistic lock)."""

    model_config = ConfigDict(extra="forbid")

    version: int = Field(description="The version being edited; 409 if it moved on.")
    options: dict[str, Any] = Field(
        description='Options to change, e.g. {"cron": "*/5 * * * *", "retries": 3}.'
    )


class VersionOut(BaseModel):
    """One saved version of a job definition."""

    version: int
    action: DefinitionChange = Field(description="What made this version.")
    actor: str
    at: datetime
    paused: bool
    options: JobOptions
    rolled_back_to: int | None = Field(
        description="For a rollback: the version whose options were restored."
    )

    @classmethod
    def of(cls, v: DefinitionVersion) -> VersionOut:
        return cls(
            version=v.version,
            action=v.action,
            actor=v.actor,
            at=v.at,
            paused=v.paused,
            options=v.options,
            rolled_back_to=v.rolled_back_to,
        )


class RollbackIn(BaseModel):
    """Restore the options of an older version, as a new version."""

    model_config = ConfigDict(extra="forbid")

    to_version: int = Field(
        ge=1, le=VERSION_MAX, description="The version whose options to restore."
    )
    version: int = Field(
        ge=1, le=VERSION_MAX, description="The current version, as you read it; 409 if not."
    )


class TriggerIn(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    args: Args = Field(
        default=None,
        description="JSON arguments, validated against the job: at most 64 levels deep and "
        "1 MiB encoded, finite numbers, text without NUL.",
    )
    run_at: DueTime | None = Field(
        default=None, description="Run at this time (with a UTC offset; not with delay_s)."
    )
    delay_s: float | None = Field(
        default=None, ge=0, le=MAX_DELAY_S, description="Run after this many seconds."
    )
    priority: int | None = Field(default=None, ge=PRIORITY_MIN, le=PRIORITY_MAX)
    pinned_worker: ShortText | None = Field(
        default=None, description="Only this worker may run it."
    )

    @field_validator("delay_s", "priority", mode="before")
    @classmethod
    def _not_a_bool(cls, value: Any) -> Any:
        return not_a_bool(value)  # (true was a priority of 1, a delay of 1 s)


class BatchTriggerItem(TriggerIn):
    job_key: ShortText
    idempotency_key: IdempotencyKey | None = Field(
        default=None,
        description="As the Idempotency-Key header of a single trigger: a replay returns the "
        "first instance; the key reused with a different request is a 409. Keys starting "
        "with `retry-of:` are reserved.",
    )


class BatchTriggerIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: list[BatchTriggerItem] = Field(min_length=1, max_length=1000)


class ErrorOut(BaseModel):
    type: str
    message: str
    traceback: str | None = None


class TransitionOut(BaseModel):
    seq: int
    from_state: InstanceState | None
    to_state: InstanceState
    at: datetime
    actor: str
    reason: str | None
    claim_token: int | None

    @classmethod
    def of(cls, t: Transition) -> TransitionOut:
        return cls(
            seq=t.seq,
            from_state=t.from_state,
            to_state=t.to_state,
            at=t.at,
            actor=t.actor,
            reason=t.reason,
            claim_token=t.claim_token,
        )


class AttemptOut(BaseModel):
    """One attempt: from an entry to Processing to the next transition out of it."""

    number: int = Field(description="1 for the first attempt.")
    worker: str = Field(description="The worker that claimed it.")
    started_at: datetime
    ended_at: datetime | None = Field(description="Null while it runs.")
    outcome: InstanceState | None = Field(description="The state it ended in; null while it runs.")
    reason: str | None = Field(description="Why it ended that way, when recorded.")
    error: ErrorOut | None = Field(
        description="Its error, for the latest ended attempt that did not succeed (only the "
        "latest error is kept)."
    )

    @classmethod
    def of(cls, a: Attempt) -> AttemptOut:
        return cls(
            number=a.number,
            worker=a.worker,
            started_at=a.started_at,
            ended_at=a.ended_at,
            outcome=a.outcome,
            reason=a.reason,
            error=ErrorOut(**a.error.to_json()) if a.error else None,
        )


class InstanceOut(BaseModel):
    id: UUID
    job_key: str
    state: InstanceState
    source: str
    queue: str
    priority: int
    args: Any
    created_at: datetime
    scheduled_at: datetime | None
    run_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    attempt: int
    retries_used: int
    unexpected_retries_used: int
    worker_id: str | None
    cancel_requested: bool
    pinned_worker: str | None
    retry_of: UUID | None
    progress: float | None
    progress_message: str | None
    checkpoint: Any
    result: Any
    error: ErrorOut | None
    reason: str | None
    transitions: list[TransitionOut] | None = None
    attempts: list[AttemptOut] | None = Field(
        default=None,
        description="The attempts, oldest first, derived from the transitions (instance "
        "detail only).",
    )
    omitted: list[str] = Field(
        default_factory=list,
        description="The fields left out (null here). In lists: `args`, `checkpoint` or "
        f"`result` larger than {LIST_VALUE_MAX} bytes, and `error.traceback`; read the instance "
        "for them. Anywhere: a value stored by an older version that cannot be serialised "
        "(nested too deep).",
    )

    @classmethod
    def brief(cls, i: Instance) -> InstanceOut:
        """For a list: large values left out (named in ``omitted``), so that a page of 500
        instances stays a few megabytes whatever the jobs carry."""
        out = cls.of(i, max_bytes=LIST_VALUE_MAX)
        if out.error is not None and out.error.traceback is not None:
            out.error.traceback = None
            out.omitted.append("error.traceback")
        if out.error is not None and len(out.error.message) > LIST_VALUE_MAX:
            out.error.message = out.error.message[:LIST_VALUE_MAX] + "…"
        return out

    def _leave_out_unreadable(self, max_bytes: int, args_checked: bool) -> None:
        # Values over ``max_bytes``, and values stored before the entrances checked them
        # (nested too deep to serialise, NaN), are left out instead of failing the answer.
        for name in ("checkpoint", "result") if args_checked else ("args", "checkpoint", "result"):
            value = getattr(self, name)
            if value is None:
                continue
            try:
                check_json(value, name, max_bytes=max_bytes)
            except InvalidOptionsError:
                setattr(self, name, None)
                self.omitted.append(name)

    @classmethod
    def of(
        cls,
        i: Instance,
        transitions: list[Transition] | None = None,
        *,
        max_bytes: int = MAX_RESULT_BYTES,
        args_checked: bool = False,
    ) -> InstanceOut:
        """``args_checked``: the arguments are the ones this request brought, checked at the
        entrance (a new instance's): not checked again here (a batch of 1,000 spent a sixth of
        the API's time checking arguments, three times each, docs/benchmarks.md)."""
        out = cls(
            id=i.id,
            job_key=i.job_key,
            state=i.state,
            source=i.source.value,
            queue=i.queue,
            priority=i.priority,
            args=i.args,
            created_at=i.created_at,
            scheduled_at=i.scheduled_at,
            run_at=i.run_at,
            started_at=i.started_at,
            finished_at=i.finished_at,
            attempt=i.attempt,
            retries_used=i.retries_used,
            unexpected_retries_used=i.unexpected_retries_used,
            worker_id=i.worker_id,
            cancel_requested=i.cancel_requested,
            pinned_worker=i.pinned_worker,
            retry_of=i.retry_of,
            progress=i.progress,
            progress_message=i.progress_message,
            checkpoint=i.checkpoint,
            result=i.result,
            error=ErrorOut(**i.error.to_json()) if i.error else None,
            reason=i.reason,
            transitions=[TransitionOut.of(t) for t in transitions] if transitions else None,
            attempts=[AttemptOut.of(a) for a in attempts_of(transitions, i.error)]
            if transitions
            else None,
        )
        out._leave_out_unreadable(max_bytes, args_checked)
        return out


class InstancePage(BaseModel):
    items: list[InstanceOut]
    next_cursor: UUID | None = Field(description="Pass as `before` to get the next page.")
