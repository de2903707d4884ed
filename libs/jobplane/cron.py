"""Cron expressions: validation and fire times, on top of croniter.

Expressions have 5 fields (minute precision) or 6, the sixth being seconds, as in DESIGN.md.
Fire times are computed in the job's IANA time zone and returned as aware UTC datetimes.
"""

from __future__ import annotations

from datetime import UTC, datetime
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterError, croniter

from jobplane.errors import InvalidOptionsError


def validate_cron(expression: str, field: str = "cron") -> str:
    """Return ``expression`` normalised (single spaces) or raise :class:`InvalidOptionsError`."""
    parts = expression.split()
    if len(parts) not in (5, 6):
        raise InvalidOptionsError(
            field, f"expected 5 or 6 fields (6th = seconds), got {len(parts)}: {expression!r}"
        )
    normalised = " ".join(parts)
    try:
        croniter(normalised)
    except (CroniterError, ValueError, KeyError) as exc:
        raise InvalidOptionsError(field, f"not a valid cron expression: {exc}") from exc
    return normalised


def validate_timezone(name: str, field: str = "timezone") -> ZoneInfo:
    """Return the :class:`ZoneInfo` for an IANA name or raise :class:`InvalidOptionsError`."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise InvalidOptionsError(field, f"unknown IANA time zone {name!r}") from exc


def next_fire_times(expression: str, tz: str, after: datetime, count: int) -> list[datetime]:
    """The next ``count`` fire times strictly after ``after`` (an aware datetime)."""
    if after.tzinfo is None:
        raise ValueError("after must be timezone-aware")
    # The leader's own rules (daylight saving included), so what is shown is what fires.
    schedule = CronSchedule(expression, tz)
    out: list[datetime] = []
    for _ in range(count):
        after = schedule.next_after(after)
        out.append(after)
    return out


class CronSchedule:
    """Fire times of one expression in one time zone, with the daylight-saving rules of Vixie
    cron (and Cronos):

    - a wall-clock time skipped in spring (e.g. 02:30 when clocks jump 02:00 → 03:00) fires
      once, right after the gap (03:00);
    - a time repeated in autumn (02:30 happens twice when clocks go 03:00 → 02:00) fires once,
      the first time, when the hour field is fixed (``30 2 * * *``);
    - expressions whose hour field is ``*`` or a step (``*/15 * * * *``, ``0 */2 * * *``, any
      seconds or minutes step) keep their cadence in elapsed time across both changes.

    All times going in and out are aware; results are in UTC.
    """

    def __init__(self, expression: str, timezone: str) -> None:
        self.expression = validate_cron(expression)
        self.zone = validate_timezone(timezone)
        hour_field = self.expression.split()[1]
        # A fixed hour (e.g. 2, 1-3, 2,14) fires once per wall-clock time.
        self._fixed_hour = not hour_field.startswith("*")
        # Parsing dominates croniter's cost (~5x a step): parse once, re-seat per call. The
        # leader computes a next fire per job per tick, so this is its hot path.
        self._iter = croniter(self.expression, datetime.now(self.zone))

    def next_after(self, after: datetime) -> datetime:
        """The first fire time strictly after ``after``."""
        if after.tzinfo is None:
            raise ValueError("after must be timezone-aware")
        it = self._iter
        it.set_current(after.astimezone(self.zone), force=True)
        while True:
            candidate: datetime = it.get_next(datetime)
            if not (self._fixed_hour and _second_of_repeated(candidate)):
                return candidate.astimezone(UTC)

    def between(self, after: datetime, until: datetime, limit: int) -> list[datetime]:
        """Fire times in ``(after, until]``, at most ``limit`` (the earliest ones)."""
        out: list[datetime] = []
        current = after
        while len(out) < limit:
            current = self.next_after(current)
            if current > until:
                break
            out.append(current)
        return out


def _second_of_repeated(moment: datetime) -> bool:
    """Whether ``moment`` is the second occurrence of a wall-clock time repeated in autumn."""
    wall = moment.replace(tzinfo=None)
    zone = moment.tzinfo
    first = wall.replace(fold=0, tzinfo=zone)
    second = wall.replace(fold=1, tzinfo=zone)
    if first.utcoffset() == second.utcoffset():
        return False  # not an ambiguous time
    return moment.utcoffset() == second.utcoffset()
