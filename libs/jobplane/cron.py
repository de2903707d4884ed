"""Cron expressions: validation and fire times, on top of croniter.

Expressions have 5 fields (minute precision) or 6, the sixth being seconds, as in DESIGN.md.
Fire times are computed in the job's IANA time zone and returned as aware UTC datetimes.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterError, croniter

from jobplane.errors import InvalidOptionsError

_JUST_BEFORE = timedelta(microseconds=1)


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
    """Fire times of one expression in one time zone. Daylight-saving rules:

    - a wall-clock time skipped in spring (e.g. 02:30 when clocks jump 02:00 → 03:00) fires
      once, right after the gap (03:00);
    - a time repeated in autumn (02:30 happens twice when clocks go 03:00 → 02:00) fires once,
      the first time, when the hour field is fixed (``30 2 * * *``, ``0 1-3 * * *``);
    - when the hour field is ``*`` (``*/15 * * * *``, ``0 * * * *``, any seconds or minutes
      step) the wall clock is followed through both passes of a repeated hour, which keeps the
      cadence in elapsed time (as Vixie cron and Cronos do);
    - when the hour field is a step of two hours or more (``*/n``, ``a/n``, ``a-b/n``: an
      interval job) the cadence is kept in elapsed time across the change: on each local day
      the tick at wall position h:m:s of an ordinary 24-hour day fires h:m:s of *elapsed*
      time after that day's local midnight. On ordinary days this is the wall clock. On a
      change day it keeps every interval of the day as on an ordinary day, and the hour the
      day lacks (spring) or has extra (autumn) falls on the interval that crosses the next
      midnight, where the hour steps restart anyway. So in Berlin ``0 */2 * * *`` fires
      00:00 CET, 03:00 CEST (2 h later), 05:00, … 23:00 CEST, then 00:00 (1 h) in spring, and
      00:00 CEST, 02:00 CEST, 03:00 CET (2 h later), … 21:00 CET, then 00:00 (3 h) in autumn.
      Note this differs from Cronos and Vixie cron, which fire an hour step in both passes
      of the repeated hour (2 h, 1 h, 2 h): here no interval near the change is shortened
      or stretched. (Vixie and Cronos behave the same as here on a day without a change.)

    All times going in and out are aware; results are in UTC.
    """

    def __init__(self, expression: str, timezone: str) -> None:
        self.expression = validate_cron(expression)
        self.zone = validate_timezone(timezone)
        hour_field = self.expression.split()[1]
        # A fixed hour (e.g. 2, 1-3, 2,14) fires once per wall-clock time.
        self._fixed_hour = not hour_field.startswith("*") and "/" not in hour_field
        # An hour step of 2 or more keeps its cadence in elapsed time (see above).
        self._hour_step = any(
            int(part.split("/")[1]) >= 2 for part in hour_field.split(",") if "/" in part
        )
        # The same expression on a plain clock (UTC: no change ever), for hour steps.
        self._plain = croniter(self.expression, datetime(2000, 1, 1, tzinfo=UTC))
        # Parsing dominates croniter's cost (~5x a step): parse once, re-seat per call. The
        # leader computes a next fire per job per tick, so this is its hot path.
        self._iter = croniter(self.expression, datetime.now(self.zone))

    def next_after(self, after: datetime) -> datetime:
        """The first fire time strictly after ``after``."""
        if after.tzinfo is None:
            raise ValueError("after must be timezone-aware")
        if self._hour_step:
            return self._next_elapsed(after)
        it = self._iter
        it.set_current(after.astimezone(self.zone), force=True)
        while True:
            candidate: datetime = it.get_next(datetime)
            if not (self._fixed_hour and _second_of_repeated(candidate)):
                return candidate.astimezone(UTC)

    def _next_elapsed(self, after: datetime) -> datetime:
        """Hour steps: the first tick strictly after ``after``, where the tick at plain-clock
        position p of local day D fires at midnight(D) + p in elapsed time."""
        day = after.astimezone(self.zone).date()
        while True:
            start = self._midnight(day)
            plain_midnight = datetime.combine(day, time(), UTC)
            # Where ``after`` lies on day D's plain clock (just before it if it is earlier).
            base = plain_midnight + max(after - start, -_JUST_BEFORE)
            self._plain.set_current(base, force=True)
            candidate: datetime = self._plain.get_next(datetime)
            if candidate.date() == day:
                return start + (candidate - plain_midnight)
            day += timedelta(days=1)

    def _midnight(self, day: date) -> datetime:
        """The first instant of local ``day`` (if midnight is skipped, the end of the gap)."""
        return datetime.combine(day, time(), self.zone).astimezone(UTC)

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
