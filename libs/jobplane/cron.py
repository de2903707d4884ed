"""Cron expressions: validation and fire times, on top of croniter.

Expressions have 5 fields (minute precision) or 6, the sixth being seconds, as in DESIGN.md.
Fire times are computed in the job's IANA time zone and returned as aware UTC datetimes.
"""

from __future__ import annotations

from datetime import datetime
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
    zone = validate_timezone(tz)
    it = croniter(expression, after.astimezone(zone))
    return [it.get_next(datetime) for _ in range(count)]
