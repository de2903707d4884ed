"""Job options with their validation (README, "A job, end to end").

Options are declared in code; the first registration persists them and the stored ones win
afterwards. :meth:`JobOptions.parse` turns any bad value into an :class:`InvalidOptionsError`
naming the field at fault.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from jobplane.cron import CronSchedule, validate_cron, validate_timezone
from jobplane.domain.limits import INT32_MAX, check_text, is_a_number, to_utc
from jobplane.errors import InvalidOptionsError

PRIORITY_MIN = 0
PRIORITY_MAX = 9
PRIORITY_DEFAULT = 5

# \A and \Z, not ^ and $: "$" also matches before a final newline, and a key, queue or
# zone name ending in one passed (a queue "mail\n" that no worker may consume).
KEY_PATTERN = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9_.:\-]{0,199}\Z")
#: Stored in every version of a definition: bounded so that versions stay cheap.
NAME_MAX = 200
DESCRIPTION_MAX = 4000
#: Ten years: a longer timeout or delay is a mistake, not a setting.
SECONDS_MAX = 10 * 365 * 24 * 3600.0
# Queue names become part of Redis keys inside a hash tag: no braces, no colons, no spaces.
QUEUE_PATTERN = re.compile(r"\A[a-z0-9][a-z0-9_.\-]{0,63}\Z")


#: The most missed ticks ``fire_all`` fires after an outage. A catch-up pass computes that many
#: ticks before it writes anything (the leader's loop waits meanwhile), and fires them in one
#: statement: 100,000 took 1.7-2.0 s of CPU per pass on a 2-core machine.
MISFIRE_MAX = 10_000
#: The least ``misfire_grace_s`` a definition may be given: the leader fires every tick a few
#: milliseconds late, more on a loaded machine, so below this ``skip`` skipped ticks fired on
#: time (at 0, every tick).
MISFIRE_GRACE_MIN = 0.5


class JobKind(StrEnum):
    RECURRING = "recurring"
    TRIGGERED = "triggered"


class OnLimit(StrEnum):
    """What happens to an instance claimed while its job is at max concurrency."""

    SKIP = "skip"  # it ends Skipped, with the reason recorded (the seed's default)
    WAIT = "wait"  # it stays Enqueued until a slot frees


class MisfirePolicy(StrEnum):
    """How a recurring job catches up ticks missed during downtime or failover."""

    FIRE_ONCE = "fire_once"
    FIRE_ALL = "fire_all"
    SKIP = "skip"


class Isolation(StrEnum):
    """Where a job's code runs inside the worker."""

    NONE = "none"  # async jobs on the event loop, sync jobs in the thread pool
    PROCESS = "process"  # a child process per attempt: a timeout or cancel kills it for real


class PinFallback(StrEnum):
    """What happens to an instance pinned to a worker that is gone."""

    ANY = "any"  # any worker of the queue may run it
    FAIL = "fail"  # it ends Terminated (reason: pinned worker gone)


class BackoffKind(StrEnum):
    NONE = "none"
    FIXED = "fixed"
    EXPONENTIAL = "exponential"


class Backoff(BaseModel):
    """Delay before a retry: none, fixed, or exponential with optional jitter, capped."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    kind: BackoffKind = BackoffKind.EXPONENTIAL
    delay_s: float = Field(default=1.0, ge=0, le=SECONDS_MAX)
    factor: float = Field(default=2.0, ge=1, le=1000)
    max_delay_s: float = Field(default=300.0, ge=0, le=SECONDS_MAX)
    jitter: bool = True

    @field_validator("delay_s", "factor", "max_delay_s", mode="before")
    @classmethod
    def _not_a_bool(cls, value: Any) -> Any:
        return not_a_bool(value)

    def delay_for(self, retry_number: int, random_fraction: float = 1.0) -> float:
        """Seconds to wait before retry number ``retry_number`` (1-based).

        ``random_fraction`` in [0, 1] applies "full jitter" when :attr:`jitter` is on.
        """
        if self.kind is BackoffKind.NONE:
            return 0.0
        if self.kind is BackoffKind.FIXED or not self.delay_s:
            base = self.delay_s
        else:
            try:
                growth = self.factor ** max(retry_number - 1, 0)
            except OverflowError:
                # Past any float (a large factor, or retries in the thousands): past any cap.
                growth = math.inf
            base = self.delay_s * growth
        base = min(base, self.max_delay_s)
        return base * random_fraction if self.jitter else base


class JobOptions(BaseModel):
    """Every option of a job definition. Frozen: an edit produces a new value."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    key: str
    kind: JobKind
    name: str = ""
    description: str = ""
    queue: str = "default"
    priority: int = Field(default=PRIORITY_DEFAULT, ge=PRIORITY_MIN, le=PRIORITY_MAX)
    max_concurrency: int = Field(default=1, ge=1, le=INT32_MAX)
    on_limit: OnLimit = OnLimit.SKIP
    retries: int = Field(default=0, ge=0, le=INT32_MAX)
    backoff: Backoff = Backoff()
    max_unexpected_retries: int = Field(default=3, ge=0, le=INT32_MAX)
    timeout_s: float = Field(default=3600.0, gt=0, le=SECONDS_MAX)
    isolation: Isolation = Isolation.NONE
    #: A retry runs on the worker that ran the failed attempt (pinned to it).
    retry_on_same_worker: bool = False
    pin_fallback: PinFallback = PinFallback.ANY
    disabled: bool = False
    # Recurring only.
    cron: str | None = None
    timezone: str = "UTC"
    start_at: datetime | None = None
    end_at: datetime | None = None
    misfire: MisfirePolicy = MisfirePolicy.FIRE_ONCE
    #: Stored values above :data:`MISFIRE_MAX` (accepted before it) are read back as they are;
    #: the catch-up applies at most ``MISFIRE_MAX``.
    misfire_max: int = Field(
        default=100, ge=1, le=INT32_MAX, json_schema_extra={"maximum": MISFIRE_MAX}
    )
    #: A tick later than this (seconds) is a misfire and follows ``misfire``, whoever fires it:
    #: a new leader after a failover, or a sitting leader that fell behind.
    #: Stored values below :data:`MISFIRE_GRACE_MIN` (accepted before it) are read back as they
    #: are.
    misfire_grace_s: float = Field(
        default=1.0, ge=0, le=86_400, json_schema_extra={"minimum": MISFIRE_GRACE_MIN}
    )

    @field_validator(
        "priority",
        "max_concurrency",
        "retries",
        "max_unexpected_retries",
        "timeout_s",
        "misfire_max",
        "misfire_grace_s",
        mode="before",
    )
    @classmethod
    def _not_a_bool(cls, value: Any) -> Any:
        return not_a_bool(value)

    @field_validator("key")
    @classmethod
    def _key(cls, value: str) -> str:
        if not KEY_PATTERN.match(value):
            raise ValueError(
                "must be 1-200 characters of letters, digits, '_', '.', ':' or '-', "
                "starting with a letter or digit"
            )
        return value

    @field_validator("name", "description")
    @classmethod
    def _text(cls, value: str, info: ValidationInfo) -> str:
        # Stored values are read back as they are, even if saved before these bounds.
        if _stored(info):
            return value
        limit = NAME_MAX if info.field_name == "name" else DESCRIPTION_MAX
        try:
            return check_text(value, str(info.field_name), max_length=limit)
        except InvalidOptionsError as exc:
            raise ValueError(exc.reason) from None

    @field_validator("misfire_max")
    @classmethod
    def _misfire_max(cls, value: int, info: ValidationInfo) -> int:
        if value > MISFIRE_MAX and not _stored(info):
            raise ValueError(f"must be at most {MISFIRE_MAX}")
        return value

    @field_validator("misfire_grace_s")
    @classmethod
    def _misfire_grace(cls, value: float, info: ValidationInfo) -> float:
        if value < MISFIRE_GRACE_MIN and not _stored(info):
            raise ValueError(
                f"must be at least {MISFIRE_GRACE_MIN} (the leader fires a few milliseconds "
                "late: below this, skip would skip ticks fired on time)"
            )
        return value

    @field_validator("queue")
    @classmethod
    def _queue(cls, value: str) -> str:
        if not QUEUE_PATTERN.match(value):
            raise ValueError(
                "must be 1-64 characters of lowercase letters, digits, '_', '.' or '-', "
                "starting with a letter or digit"
            )
        return value

    @field_validator("cron")
    @classmethod
    def _cron(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None or _stored(info):
            return value
        return validate_cron(value)

    @field_validator("timezone")
    @classmethod
    def _timezone(cls, value: str, info: ValidationInfo) -> str:
        if not _stored(info):
            validate_timezone(value)
        return value

    @field_validator("start_at", "end_at", mode="before")
    @classmethod
    def _not_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        if is_a_number(value):  # (read as Unix seconds or milliseconds: see is_a_number)
            raise InvalidOptionsError(
                str(info.field_name),
                "give the time as ISO 8601 text (2026-01-01T09:00:00Z), not a number",
            )
        return value

    @field_validator("start_at", "end_at")
    @classmethod
    def _aware(cls, value: datetime | None, info: ValidationInfo) -> datetime | None:
        if value is None or _stored(info):
            return value
        return to_utc(value, str(info.field_name), naive_is_utc=False)

    @model_validator(mode="after")
    def _coherent(self) -> Self:
        if self.start_at and self.end_at and self.start_at >= self.end_at:
            raise InvalidOptionsError("end_at", "must be later than start_at")
        if self.kind is JobKind.TRIGGERED:
            for field in ("cron", "start_at", "end_at"):
                if getattr(self, field) is not None:
                    raise InvalidOptionsError(field, "only recurring jobs take this option")
        if not self.name:
            object.__setattr__(self, "name", self.key)
        return self

    @model_validator(mode="wrap")
    @classmethod
    def _fires_in_its_zone(
        cls, data: Any, handler: ModelWrapValidatorHandler[Self], info: ValidationInfo
    ) -> Self:
        """An expression that never fires in the job's zone (``*/15 2 * 3 0#2`` in New York:
        its every match falls in a spring gap) is refused where options enter: the per-field
        check reads the expression without the zone. Not for options read back (see
        :data:`STORED`), nor for options already made (a response model holding a stored
        job's options validates them again): the leader and the API show their schedule's
        error per job."""
        made = isinstance(data, JobOptions)
        options = handler(data)
        if made or options.cron is None or _stored(info):
            return options
        try:
            CronSchedule(options.cron, options.timezone).next_after(datetime.now(UTC))
        except InvalidOptionsError:
            raise InvalidOptionsError(
                "cron", f"{options.cron!r} never fires in time zone {options.timezone}"
            ) from None
        return options

    @classmethod
    def from_stored(cls, values: Any) -> JobOptions:
        """Options read back from the store (see :data:`STORED`)."""
        return cls.model_validate(values, context=STORED)

    @classmethod
    def parse(cls, **values: Any) -> JobOptions:
        """Validate ``values``; raise :class:`InvalidOptionsError` naming the first bad field."""
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            raise options_error(exc) from exc

    def edited(self, **changes: Any) -> JobOptions:
        """A copy with ``changes`` applied and validated; ``key`` and ``kind`` are immutable."""
        for immutable in ("key", "kind"):
            if immutable in changes and changes[immutable] != getattr(self, immutable):
                raise InvalidOptionsError(immutable, "cannot be changed")
        return JobOptions.parse(**{**self.model_dump(), **changes})


#: Validation context for options read back from the store. They were validated when they
#: were saved, but the rules for a schedule may have grown stricter since (an expression that
#: can never fire is refused today): such a job must still be listed, edited and shown with its
#: schedule's error (the leader and the API compute it per job), never make every read fail.
STORED: dict[str, bool] = {"stored": True}


def _stored(info: ValidationInfo) -> bool:
    return bool(info.context and info.context.get("stored"))


def options_error(exc: ValidationError) -> InvalidOptionsError:
    """The first error of a pydantic :class:`ValidationError` as an :class:`InvalidOptionsError`."""
    first = exc.errors()[0]
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, InvalidOptionsError):
        return cause
    field = ".".join(str(part) for part in first["loc"]) or "options"
    message = first["msg"].removeprefix("Value error, ")
    return InvalidOptionsError(field, message)


def not_a_bool(value: Any) -> Any:
    """``value``, unless it is true or false: read as 1 or 0 (``"retries": true`` saved one
    retry, ``max_concurrency=True`` one at a time), a number given as a boolean is refused."""
    if isinstance(value, bool):
        raise ValueError("must be a number, not true or false")
    return value


def check_priority(value: object, field: str = "priority") -> int | None:
    """``value`` if it is a priority (an int from PRIORITY_MIN to PRIORITY_MAX) or None, else
    :class:`InvalidOptionsError`. For a trigger's own priority from code: one out of range was
    stored, and every leader that published it stopped on it (its stream band is undefined)."""
    if value is None:
        return None
    if type(value) is not int or not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise InvalidOptionsError(
            field, f"must be a whole number from {PRIORITY_MIN} to {PRIORITY_MAX}, got {value!r}"
        )
    return value


def check_delay(value: timedelta, field: str = "delay") -> timedelta:
    """``value`` if it is a delay from now (zero to ten years), else InvalidOptionsError (one
    of a billion days raised OverflowError from the clock's arithmetic)."""
    if not isinstance(value, timedelta) or not 0 <= value.total_seconds() <= SECONDS_MAX:
        raise InvalidOptionsError(field, "must be a duration from zero to ten years")
    return value
