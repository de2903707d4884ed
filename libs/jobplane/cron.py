"""Cron expressions: validation and fire times, on top of cronsim.

Expressions have 5 fields (minute precision) or 6, the sixth being seconds. The fields and
their meaning are Debian/Vixie cron's as cronsim implements them: names of months and days,
ranges, lists and steps; ``L`` (last day, ``LW`` last weekday) in the day of month; ``5L``
(last Friday) and ``5#2`` (second Friday) in the day of week. Day of month and day of week
combine with OR only when neither field starts with ``*``; otherwise both must match (so
``0 0 1,15 * */2`` is the 1st and 15th when they fall on Sunday, Tuesday, Thursday or
Saturday). Fire times are computed in the job's IANA time zone and returned as aware UTC
datetimes; the daylight-saving rules are in :class:`CronSchedule`.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from jobplane.errors import InvalidOptionsError

#: What an IANA zone name may hold, checked before the zone database is touched (a long or
#: odd name would otherwise reach the file system).
_ZONE_NAME = re.compile(r"\A[A-Za-z][A-Za-z0-9_+\-]*(/[A-Za-z0-9_+\-]+){0,3}\Z")
_ZONE_NAME_MAX = 64
#: Files of the zone database that are no zone of the world: the host's own zone (the API and
#: the scheduler may run on hosts set to different ones), and its build's leftovers.
_NOT_ZONES = frozenset({"localtime", "posixrules", "Factory"})
_NOT_ZONE_DIRS = ("posix/", "right/")
#: A reference instant for parsing: fire times never depend on it.
_REFERENCE = datetime(2000, 1, 1)
_MINUTE = timedelta(minutes=1)
#: Ticks are whole seconds: a search from this much before an instant finds a tick at it.
JUST_BEFORE = timedelta(microseconds=1)


def validate_cron(expression: str, field: str = "cron") -> str:
    """Return ``expression`` normalised (single spaces) or raise :class:`InvalidOptionsError`.

    Refuses what does not parse and what can never fire (a 30 February; a day of month that
    no day of week it must match ever meets), so that nothing stored makes the scheduler
    compute a fire time that does not exist."""
    normalised = _normalise(expression, field)
    parsed = _parse(normalised, field)
    try:
        next(_seated(parsed, datetime.now(UTC).replace(tzinfo=None)))
    except StopIteration:
        raise InvalidOptionsError(
            field, f"{normalised!r} never fires (no matching date in the next 50 years)"
        ) from None
    return normalised


def _normalise(expression: str, field: str) -> str:
    parts = expression.split()
    if len(parts) not in (5, 6):
        raise InvalidOptionsError(
            field, f"expected 5 or 6 fields (6th = seconds), got {len(parts)}: {expression!r}"
        )
    return " ".join(parts)


def _parse(normalised: str, field: str) -> CronSim:
    """The parsed expression, seated at a naive reference instant (no zone rules)."""
    parts = normalised.split()
    # cronsim writes seconds first; Jobplane (like croniter) writes them last.
    as_cronsim = " ".join([parts[5], *parts[:5]]) if len(parts) == 6 else normalised
    try:
        return CronSim(as_cronsim, _REFERENCE)
    except (CronSimError, ValueError, IndexError) as exc:
        reason = str(exc) or type(exc).__name__
        if _parses_in_any_month(as_cronsim):
            # Each field is fine alone; the day of month occurs in none of the months.
            reason = "never fires: no listed month has that day of month"
        else:
            reason = f"not a valid cron expression: {reason}"
        raise InvalidOptionsError(field, f"{reason} in {normalised!r}") from exc


def _parses_in_any_month(as_cronsim: str) -> bool:
    parts = as_cronsim.split()
    parts[-2] = "*"
    try:
        CronSim(" ".join(parts), _REFERENCE)
    except (CronSimError, ValueError, IndexError):
        return False
    return True


def _seated(parsed: CronSim, start: datetime) -> CronSim:
    """A copy of ``parsed`` that iterates from ``start`` (exclusive). Parsing dominates the
    cost of a next fire time (the leader computes one per job per tick), so an expression is
    parsed once and re-seated for each search."""
    it = copy.copy(parsed)
    it.dt = start.replace(microsecond=0)
    return it


def validate_timezone(name: str, field: str = "timezone") -> ZoneInfo:
    """Return the :class:`ZoneInfo` for an IANA name or raise :class:`InvalidOptionsError`."""
    if len(name) > _ZONE_NAME_MAX or not _ZONE_NAME.match(name):
        raise InvalidOptionsError(field, "not an IANA time zone name (e.g. Europe/Berlin)")
    if name in _NOT_ZONES or name.startswith(_NOT_ZONE_DIRS):
        raise InvalidOptionsError(field, f"{name!r} is not a time zone of the world")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError) as exc:
        raise InvalidOptionsError(field, f"unknown IANA time zone {name!r}") from exc


def search_from(start_at: datetime | None, after: datetime) -> datetime:
    """The instant the next tick is searched strictly after: ``after``, but never before
    ``start_at``, which is inclusive (a tick exactly at ``start_at`` fires, as one exactly at
    ``end_at`` does)."""
    if start_at is not None and after < start_at:
        return start_at - JUST_BEFORE
    return after


def next_fire_times(
    expression: str,
    tz: str,
    after: datetime,
    count: int,
    *,
    start_at: datetime | None = None,
    end_at: datetime | None = None,
) -> list[datetime]:
    """The next ``count`` fire times strictly after ``after`` (an aware datetime) within a
    job's window: none before ``start_at``, none after ``end_at`` (both inclusive)."""
    if after.tzinfo is None:
        raise ValueError("after must be timezone-aware")
    # The leader's own rules (daylight saving and the window included), so what is shown is
    # what fires.
    schedule = CronSchedule(expression, tz)
    out: list[datetime] = []
    after = search_from(start_at, after)
    for _ in range(count):
        after = schedule.next_after(after)
        if end_at is not None and after > end_at:
            break
        out.append(after)
    return out


class CronSchedule:
    """Fire times of one expression in one time zone. Daylight-saving rules (Debian cron's,
    as cronsim implements them):

    - when neither the minute nor the hour field starts with ``*`` (a job at fixed times:
      ``30 2 * * *``, ``0 1-3 * * *``, ``15 8-18/4 * * 1-5``) the fields are matched on the
      wall clock: a time skipped in spring (02:30 when clocks jump 02:00 → 03:00) fires once,
      at the first real minute after it (03:00; the seconds are kept); a time repeated in
      autumn fires once, on its first pass;
    - otherwise (``*/15 * * * *``, ``0 * * * *``, ``0 */7 * * *``, ``*/5 2 * * *``) the
      expression is matched against every real instant: the wall clock is followed through
      both passes of a repeated hour, and times that do not exist in spring are not fired.
      An hour step keeps its listed wall-clock hours (``0 */7 * * *`` is 00:00, 07:00, 14:00
      and 21:00 local, whatever the day), and with a 30-minute shift (Australia/Lord_Howe)
      ``*/20 * * * *`` fires 01:40 in both passes.

    Three deliberate differences from cronsim: a 6-field expression with fixed minute and
    hour follows the fixed-time rules too (cronsim applies them to 5 fields only); a fire time
    is always strictly after the instant searched from (cronsim, seated inside the second pass
    of a repeated hour, may return the first pass of the same wall time, which is earlier);
    and where the clocks move by half an hour, the matching instants cronsim's whole-hour
    steps lose fire (see :meth:`_matched_after`).

    All times going in and out are aware; results are in UTC.
    """

    def __init__(self, expression: str, timezone: str) -> None:
        self.expression = _normalise(expression, "cron")
        self.zone = validate_timezone(timezone)
        self._parsed = _parse(self.expression, "cron")
        parts = self.expression.split()
        self._wall = not parts[0].startswith("*") and not parts[1].startswith("*")
        #: The last second of a minute the expression fires at (0 with five fields).
        self._last_second = timedelta(seconds=max(self._parsed.seconds))

    def next_after(self, after: datetime) -> datetime:
        """The first fire time strictly after ``after``.

        Raises :class:`InvalidOptionsError` if the expression has no fire time left: it never
        fires (refused at registration and edit, but possible in data stored before), or not
        before the end of year 9999 (a ``start_at`` there)."""
        if after.tzinfo is None:
            raise ValueError("after must be timezone-aware")
        try:
            return self._next_after(after)
        except OverflowError:
            raise InvalidOptionsError(
                "cron",
                f"{self.expression!r} has no fire time after {after.isoformat()} before the year "
                "10000",
            ) from None

    def _next_after(self, after: datetime) -> datetime:
        if not self._wall:
            return self._matched_after(after)
        # Mapped to the clock, wall times keep their order: the first later than ``after`` is
        # the next, and the search starts at ``after``'s own wall time, unless the clocks
        # changed just before it (see _seat). (Seated 3 hours back every time, ``0-59 0-23 *
        # * * *``, every second, walked 10,800 matches per fire time: 117 ms, for each tick.)
        for wall in _fires(_seated(self._parsed, self._seat(after)), self.expression):
            found = self._on_the_clock(wall).astimezone(UTC)
            if found > after:
                return found
        raise AssertionError("unreachable: _fires raises when it runs out")

    def _seat(self, after: datetime) -> datetime:
        """The wall time a fixed-time search for the first fire time after ``after`` starts
        from (exclusive, to the second).

        Wall times before ``after``'s map to instants before it, except after a clock change
        (at most one within _GAP_MAX, at ``change``): a wall time skipped in spring fires at
        the first real minute after the gap (02:30:30, a second after 02:30:00, both moved to
        03:00: seated at 03:00:00, the second was lost), so within a minute of the change the
        search starts from the gap's first wall time; and a wall time of a repeated hour
        fired on its first pass, so in the second pass the search starts past the repeated
        wall times (they would only be walked through)."""
        after = after.astimezone(UTC)
        wall = after.astimezone(self.zone).replace(tzinfo=None)
        before = after - _GAP_MAX
        old = before.astimezone(self.zone).utcoffset()
        assert old is not None
        change = _first_change(self.zone, before, after, old)
        if change is None:
            return wall
        new = change.astimezone(self.zone).utcoffset()
        assert new is not None
        # The last wall second of the old offset: the gap's, or the repeated hour's, first
        # wall time is the next one.
        last_old = (change + old).replace(tzinfo=None).replace(microsecond=0) - _SECOND
        if new < old:
            return max(wall, last_old)
        # A skipped wall time is moved by whole minutes, its seconds kept, to the first that
        # exists: it fires at ``change`` plus its seconds. Once ``after`` is past the last of
        # those, the gap holds nothing later and is not walked (walked, its 3,600 wall times
        # of ``0-59 0-23 * * * *`` took 0.4 s in the last seconds of the minute).
        return last_old if after < change + self._last_second else wall

    def _matched_after(self, after: datetime) -> datetime:
        """The first real instant after ``after`` whose wall time (at its own offset) matches.

        Between two clock changes the offset is fixed, so each such stretch is matched on its
        own wall clock by cronsim without a zone: the stretch's first match is the next fire
        time if it comes before the stretch ends, else the search goes on from the change.
        (cronsim's own zone handling moves across a change by whole hours: with a shift of
        half an hour, Australia/Lord_Howe, it skipped matching instants up to a day after the
        change, and around Pacific/Chatham's autumn change ``45 */3 * * *`` never returned.)
        """
        start, inclusive = after.astimezone(UTC), False  # (the arithmetic below is UTC's)
        give_up = start + _SEARCH_MAX if start < _LAST_SEARCH else None
        naive: datetime | None = None
        searched = datetime.min
        while True:
            if give_up is not None and start > give_up:
                # Each stretch's first match fell in a time that does not exist (``*/15 2 *
                # 3 0#2`` in New York: a spring gap, every year): as cronsim, give up.
                raise InvalidOptionsError("cron", f"{self.expression!r} never fires")
            offset = start.astimezone(self.zone).utcoffset()
            assert offset is not None
            wall = (start + offset).replace(tzinfo=None)
            # cronsim searches strictly after a whole second; a change is on a whole second.
            seat = (wall - _SECOND if inclusive else wall).replace(microsecond=0)
            # The last search's match is still the first after a later seat before it (there
            # was none between them): a rare expression is searched for once, not once per
            # change on the way to it.
            if naive is None or not searched <= seat < naive:
                naive = next(_fires(_seated(self._parsed, seat), self.expression))
                searched = seat
            found = (naive - offset).replace(tzinfo=UTC)
            change = _first_change(self.zone, start, found, offset)
            if change is None:
                return found
            start, inclusive = change, True

    def _on_the_clock(self, wall: datetime) -> datetime:
        """A wall time in the zone: its first pass if repeated, or the first real minute after
        it (same seconds) if skipped."""
        moment = wall.replace(tzinfo=self.zone, fold=0)
        if not _is_skipped(moment):
            return moment
        # Moved at once to the first whole minute from it at or past the gap's end, rather
        # than a minute at a time (up to 60 steps, each a look at the zone, per wall time).
        end = _gap_end(self.zone, moment.astimezone(UTC))
        wall -= ((wall - end) // _MINUTE) * _MINUTE  # (wall < end: floor of a negative)
        moment = wall.replace(tzinfo=self.zone, fold=0)
        while _is_skipped(moment):  # (a gap that ends on no whole minute: step on)
            wall += _MINUTE
            moment = wall.replace(tzinfo=self.zone, fold=0)
        return moment

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


#: Longer than any clock change (a summer time's hour, the two hours of a double one).
_GAP_MAX = timedelta(hours=3)


_DAY = timedelta(days=1)
_SECOND = timedelta(seconds=1)
#: A search for a fire time gives up after this long (cronsim's own limit).
_SEARCH_MAX = timedelta(days=50 * 366)
_LAST_SEARCH = datetime(9000, 1, 1, tzinfo=UTC)  # (past it, the year 10000 ends a search)
_LAST_DAYS = datetime(9999, 12, 30, tzinfo=UTC)


def _first_change(
    zone: ZoneInfo, after: datetime, until: datetime, offset: timedelta
) -> datetime | None:
    """The first instant in ``(after, until]`` (UTC) at which ``zone``'s UTC offset differs
    from ``offset``, its offset at ``after``, or None. A search shorter than a day (the common
    case) reads one more offset; a longer one looks the changes up by year (_changes_in)."""
    if until - after <= _DAY:
        if until.astimezone(zone).utcoffset() == offset:
            return None
        return _change_in(zone, after, until, offset)
    for year in range(after.year, until.year + 1):
        for change in _changes_in(zone, year):
            if after < change <= until:
                return change
    return None


@functools.lru_cache(maxsize=4096)
def _changes_in(zone: ZoneInfo, year: int) -> tuple[datetime, ...]:
    """The instants of ``year`` (UTC) at which ``zone``'s offset changes, each the first of
    its new offset. Two changes of a zone are never within a day of each other (the closest
    in the zone database are four days apart: tests/test_cron_dst.py checks it), so a step
    of a day sees each; then halving finds it. Computed once per zone and year."""
    lo = datetime(year, 1, 1, tzinfo=UTC) - JUST_BEFORE
    # (Year 9999 stops short of its last days: any zone's wall clock there is past the year.)
    end = datetime(year + 1, 1, 1, tzinfo=UTC) if year < 9999 else _LAST_DAYS
    found = []
    offset = lo.astimezone(zone).utcoffset()
    while lo < end - JUST_BEFORE:
        hi = end - JUST_BEFORE if end - lo <= _DAY else lo + _DAY
        if hi.astimezone(zone).utcoffset() != offset:
            hi = _change_in(zone, lo, hi, offset)
            offset = hi.astimezone(zone).utcoffset()
            found.append(hi)
        lo = hi
    return tuple(found)


def _change_in(zone: ZoneInfo, lo: datetime, hi: datetime, offset: timedelta | None) -> datetime:
    """The first instant of ``(lo, hi]`` whose offset is not ``offset`` (``lo``'s; ``hi``'s
    is another), by halving."""
    while hi - lo > JUST_BEFORE:
        mid = lo + (hi - lo) / 2
        if mid.astimezone(zone).utcoffset() == offset:
            lo = mid
        else:
            hi = mid
    return hi


def _gap_end(zone: ZoneInfo, past: datetime) -> datetime:
    """The first wall time after the gap a skipped wall time falls in: the wall time, on the
    new offset's clock, of the latest change at or before ``past`` (the skipped wall time read
    at the old offset, an instant after the change)."""
    changes = (*_changes_in(zone, past.year - 1), *_changes_in(zone, past.year))
    change = max(c for c in changes if c <= past)
    return change.astimezone(zone).replace(tzinfo=None)


def _fires(it: CronSim, expression: str) -> Iterator[datetime]:
    """The fire times of a seated cronsim; "none in the next 50 years" is a clear error."""
    yield from it
    raise InvalidOptionsError("cron", f"{expression!r} never fires")


def _is_skipped(moment: datetime) -> bool:
    """Whether an aware wall time does not exist (it falls in a spring-forward gap)."""
    return moment.astimezone(UTC).astimezone(moment.tzinfo).replace(tzinfo=None) != (
        moment.replace(tzinfo=None)
    )
