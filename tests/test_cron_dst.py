"""Cron fire times across daylight-saving changes (rules in libs/jobplane/cron.py)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from zoneinfo import ZoneInfo, available_timezones
from zoneinfo._zoneinfo import (  # type: ignore[import-not-found]  # (lists transitions)
    ZoneInfo as PythonZoneInfo,
)

import pytest
from cronsim import CronSim

from jobplane import cron as cron_module
from jobplane.cron import JUST_BEFORE, CronSchedule, next_fire_times
from jobplane.errors import InvalidOptionsError


def fires(expr: str, tz: str, start: datetime, n: int) -> list[str]:
    schedule = CronSchedule(expr, tz)
    zone = ZoneInfo(tz)
    out, current = [], start
    for _ in range(n):
        current = schedule.next_after(current)
        assert current.tzinfo is UTC
        out.append(current.astimezone(zone).strftime("%m-%d %H:%M%z"))
    return out


@pytest.mark.parametrize(
    ("expr", "tz", "start", "expected"),
    [
        # Spring: the skipped time fires once, right after the gap.
        (
            "30 2 * * *",
            "Europe/Berlin",
            datetime(2026, 3, 28, 12, tzinfo=UTC),
            ["03-29 03:00+0200", "03-30 02:30+0200"],
        ),
        (
            "30 2 * * *",
            "America/New_York",
            datetime(2026, 3, 7, 12, tzinfo=UTC),
            ["03-08 03:00-0400", "03-09 02:30-0400"],
        ),
        (
            "15 2 * * *",
            "Australia/Lord_Howe",
            datetime(2026, 10, 3, tzinfo=UTC),
            ["10-04 02:30+1100", "10-05 02:15+1100"],
        ),
        (
            "0 3 * * *",
            "Pacific/Chatham",
            datetime(2026, 9, 26, tzinfo=UTC),
            ["09-27 03:45+1345", "09-28 03:00+1345"],
        ),
        # Autumn: a fixed time in the repeated hour fires once, the first time.
        (
            "30 2 * * *",
            "Europe/Berlin",
            datetime(2026, 10, 24, 12, tzinfo=UTC),
            ["10-25 02:30+0200", "10-26 02:30+0100"],
        ),
        (
            "30 1 * * *",
            "America/New_York",
            datetime(2026, 10, 31, 12, tzinfo=UTC),
            ["11-01 01:30-0400", "11-02 01:30-0500"],
        ),
        (
            "45 1 * * *",
            "Australia/Lord_Howe",
            datetime(2026, 4, 4, tzinfo=UTC),
            ["04-05 01:45+1100", "04-06 01:45+1030"],
        ),
        (
            "0 3 * * *",
            "Pacific/Chatham",
            datetime(2026, 4, 4, tzinfo=UTC),
            ["04-05 03:00+1345", "04-06 03:00+1245"],
        ),
    ],
)
def test_fixed_times_fire_once_across_changes(
    expr: str, tz: str, start: datetime, expected: list[str]
) -> None:
    assert fires(expr, tz, start, len(expected)) == expected


def test_steps_keep_their_cadence_in_elapsed_time() -> None:
    # Berlin, autumn: every 30 minutes, through both passes of the repeated hour.
    got = fires("*/30 * * * *", "Europe/Berlin", datetime(2026, 10, 24, 23, tzinfo=UTC), 6)
    assert got == [
        "10-25 01:30+0200",
        "10-25 02:00+0200",
        "10-25 02:30+0200",
        "10-25 02:00+0100",
        "10-25 02:30+0100",
        "10-25 03:00+0100",
    ]
    # Berlin, spring: 01:30 then 03:00 is 30 minutes of elapsed time.
    got = fires("*/30 * * * *", "Europe/Berlin", datetime(2026, 3, 29, 0, tzinfo=UTC), 3)
    assert got == ["03-29 01:30+0100", "03-29 03:00+0200", "03-29 03:30+0200"]
    # Lord Howe, autumn (a 30-minute shift): 01:30-02:00 happens twice, each pass fires.
    got = fires("*/15 * * * *", "Australia/Lord_Howe", datetime(2026, 4, 4, 14, tzinfo=UTC), 6)
    assert got == [
        "04-05 01:15+1100",
        "04-05 01:30+1100",
        "04-05 01:45+1100",
        "04-05 01:30+1030",
        "04-05 01:45+1030",
        "04-05 02:00+1030",
    ]
    # Lord Howe, spring: 02:00-02:30 does not exist; 01:45 then 02:30 is 15 minutes.
    got = fires("*/15 * * * *", "Australia/Lord_Howe", datetime(2026, 10, 3, 15, tzinfo=UTC), 2)
    assert got == ["10-04 01:45+1030", "10-04 02:30+1100"]
    # New York, every hour on the hour through the autumn change: never a two-hour gap.
    schedule = CronSchedule("0 * * * *", "America/New_York")
    current = datetime(2026, 11, 1, 3, tzinfo=UTC)
    for _ in range(6):
        nxt = schedule.next_after(current)
        assert (nxt - current).total_seconds() == 3600
        current = nxt


def test_six_fields_fire_on_the_second_in_any_zone() -> None:
    schedule = CronSchedule("* * * * * */15", "Pacific/Chatham")
    start = datetime(2026, 1, 1, 0, 0, 0, tzinfo=UTC)
    assert [
        schedule.next_after(start).second,
        len(schedule.between(start, start.replace(minute=1), 10)),
    ] == [15, 4]


def gaps(expr: str, tz: str, start: datetime, n: int) -> tuple[list[str], list[float]]:
    """``n`` ticks as local wall times, and the hours of elapsed time between them."""
    schedule = CronSchedule(expr, tz)
    zone = ZoneInfo(tz)
    ticks, current = [], start
    for _ in range(n):
        current = schedule.next_after(current)
        ticks.append(current)
    hours = [(b - a).total_seconds() / 3600 for a, b in itertools.pairwise(ticks)]
    return [t.astimezone(zone).strftime("%d %H:%M%z") for t in ticks], hours


@pytest.mark.parametrize(
    ("expr", "tz", "start", "n", "expected"),
    [
        # An hour step keeps its listed wall-clock hours on a change day, as every cron does.
        (
            "0 */7 * * *",
            "Europe/Berlin",
            datetime(2026, 3, 28, 22, tzinfo=UTC),
            5,
            ["29 00:00+0100", "29 07:00+0200", "29 14:00+0200", "29 21:00+0200", "30 00:00+0200"],
        ),
        (
            "0 */7 * * *",
            "Europe/Berlin",
            datetime(2026, 10, 24, 21, tzinfo=UTC),
            4,
            ["25 00:00+0200", "25 07:00+0100", "25 14:00+0100", "25 21:00+0100"],
        ),
        # `*/2` starts with `*`: the wall clock is followed through both passes (Debian).
        (
            "0 */2 * * *",
            "Europe/Berlin",
            datetime(2026, 10, 24, 21, tzinfo=UTC),
            4,
            ["25 00:00+0200", "25 02:00+0200", "25 02:00+0100", "25 04:00+0100"],
        ),
        # ... and a listed hour skipped in spring is not fired.
        (
            "0 */2 * * *",
            "Europe/Berlin",
            datetime(2026, 3, 28, 22, tzinfo=UTC),
            3,
            ["29 00:00+0100", "29 04:00+0200", "29 06:00+0200"],
        ),
        # A fixed hour with a step is a fixed time: 17:45 only, on Lord Howe's autumn day too.
        (
            "45 17-18/2 * * *",
            "Australia/Lord_Howe",
            datetime(2026, 4, 4, 8, tzinfo=UTC),
            2,
            ["05 17:45+1030", "06 17:45+1030"],
        ),
        # A 30-minute fall-back: both passes of 01:30-02:00 fire, 01:40 included.
        (
            "*/20 * * * *",
            "Australia/Lord_Howe",
            datetime(2026, 4, 4, 14, 10, tzinfo=UTC),
            5,
            [
                "05 01:20+1100",
                "05 01:40+1100",
                "05 01:40+1030",
                "05 02:00+1030",
                "05 02:20+1030",
            ],
        ),
    ],
)
def test_wildcard_and_stepped_hours_follow_the_wall_clock(
    expr: str, tz: str, start: datetime, n: int, expected: list[str]
) -> None:
    assert gaps(expr, tz, start, n)[0] == expected


def test_hour_steps_follow_the_wall_clock_on_ordinary_days() -> None:
    ticks, _hours = gaps("0 */2 * * *", "Europe/Berlin", datetime(2026, 7, 1, 21, tzinfo=UTC), 4)
    assert ticks == ["02 00:00+0200", "02 02:00+0200", "02 04:00+0200", "02 06:00+0200"]
    ticks, _ = gaps("15 8-18/4 * * 1-5", "America/New_York", datetime(2026, 7, 3, tzinfo=UTC), 3)
    assert ticks == ["03 08:15-0400", "03 12:15-0400", "03 16:15-0400"]  # Friday
    ticks, _ = gaps("0 1-5/2,20 * * *", "Europe/Berlin", datetime(2026, 7, 1, 22, tzinfo=UTC), 4)
    assert ticks == ["02 01:00+0200", "02 03:00+0200", "02 05:00+0200", "02 20:00+0200"]


def test_every_second_of_a_skipped_minute_fires_after_the_gap() -> None:
    """Each skipped time fires once, right after the gap, its seconds kept: with several in one
    skipped minute, only the first fired (the search after it started past the gap's wall
    times), and the others were lost without a record."""
    schedule = CronSchedule("30 2 * * * 0,30", "Europe/Berlin")
    zone = ZoneInfo("Europe/Berlin")
    shown, current = [], datetime(2026, 3, 28, 12, tzinfo=UTC)
    for _ in range(4):
        current = schedule.next_after(current)
        shown.append(current.astimezone(zone).strftime("%m-%d %H:%M:%S%z"))
    assert shown == [
        "03-29 03:00:00+0200",
        "03-29 03:00:30+0200",
        "03-30 02:30:00+0200",
        "03-30 02:30:30+0200",
    ]
    every = CronSchedule("30 2 * * * *", "Europe/Berlin")
    day = every.between(datetime(2026, 3, 29, tzinfo=UTC), datetime(2026, 3, 30, tzinfo=UTC), 100)
    assert len(day) == 60 and len(set(day)) == 60  # the whole minute, after the gap


def _matching_instants(expr: str, tz: str, start: datetime, end: datetime) -> list[datetime]:
    """The reference for expressions not at fixed times: every real minute in ``[start, end]``
    whose wall time, at its own offset, the expression matches."""
    zone, found, minute = ZoneInfo(tz), [], start
    while minute <= end:
        wall = minute.astimezone(zone).replace(tzinfo=None)
        if next(CronSim(expr, wall - timedelta(seconds=1))) == wall:
            found.append(minute)
        minute += timedelta(minutes=1)
    return found


@pytest.mark.parametrize(
    ("tz", "change"),
    [
        ("Australia/Lord_Howe", datetime(2026, 4, 4, 15, tzinfo=UTC)),  # 02:00 → 01:30
        ("Australia/Lord_Howe", datetime(2026, 10, 3, 15, 30, tzinfo=UTC)),  # 02:00 → 02:30
        ("Pacific/Chatham", datetime(2026, 4, 4, 14, tzinfo=UTC)),  # 03:45 → 02:45
        ("Pacific/Chatham", datetime(2026, 9, 26, 14, tzinfo=UTC)),  # 02:45 → 03:45
        ("Europe/Berlin", datetime(2026, 3, 29, 1, tzinfo=UTC)),
        ("America/New_York", datetime(2026, 11, 1, 6, tzinfo=UTC)),
    ],
)
@pytest.mark.parametrize(
    "expr", ["0 */2 * * *", "30 * * * *", "*/20 * * * *", "45 */3 * * *", "0 */7 * * *"]
)
def test_steps_and_wildcards_fire_at_every_matching_instant_across_a_change(
    tz: str, change: datetime, expr: str
) -> None:
    """Matched stretch by stretch between clock changes. cronsim's own zone handling moved
    across a change by whole hours: on Lord Howe (a 30-minute shift) it lost matching instants
    up to a day after it, with no record (``0 */7 * * *`` never fired 07:00 on the autumn
    day), and on Chatham's autumn day ``45 */3 * * *`` never returned (a leader computing it
    hung)."""
    start, end = change - timedelta(hours=20), change + timedelta(hours=20)
    schedule = CronSchedule(expr, tz)
    assert schedule.between(start - JUST_BEFORE, end, 1000) == _matching_instants(
        expr, tz, start, end
    )


def test_a_search_from_any_offset_is_a_search_from_that_instant() -> None:
    """Times going in may carry any offset (a ``start_at`` stored with its own offset before
    it was normalised): the search starts at the instant, not at its wall time read as UTC."""
    instant = datetime(2026, 6, 1, 10, tzinfo=UTC)
    expected = next_fire_times("*/15 * * * *", "Europe/Berlin", instant, 3)
    for hours in (2, -5):
        other = instant.astimezone(timezone(timedelta(hours=hours)))
        assert next_fire_times("*/15 * * * *", "Europe/Berlin", other, 3) == expected
    assert expected[0] == datetime(2026, 6, 1, 10, 15, tzinfo=UTC)


@pytest.mark.parametrize(
    ("expr", "tz"),
    [("*/15 2 * 3 0#2", "America/New_York"), ("* 2 * 3 0L", "Europe/Berlin")],
)
@pytest.mark.timeout(30)  # (the search used to run to the year 9999 on each call)
def test_an_expression_matching_only_skipped_times_never_fires(expr: str, tz: str) -> None:
    """Every match falls in a spring gap (the second Sunday of March at 2 a.m. in New York):
    each stretch's first match is in the gap, so each search went on from the change, up to
    the year 9999 (3 s per call). It gives up after 50 years, as cronsim does."""
    with pytest.raises(InvalidOptionsError, match="never fires"):
        CronSchedule(expr, tz).next_after(datetime(2026, 11, 28, tzinfo=UTC))


def test_no_zone_changes_its_clock_twice_within_a_day() -> None:
    """The search finds a zone's clock changes a day's step at a time (``_changes_in``), which
    sees every change only if no two are within a day: true of the zone database installed
    (the closest two, Africa/Freetown's in 1939, are four days apart). The pure-Python zone
    reader lists the transitions, and each rule's two changes of a year."""
    day = 86_400
    for key in sorted(available_timezones()):
        zone = PythonZoneInfo.no_cache(key)
        explicit = vars(zone)["_trans_utc"]
        assert all(b - a > day for a, b in itertools.pairwise(explicit)), key
        rule = vars(zone)["_tz_after"]
        if hasattr(rule, "transitions"):
            start, end = rule.transitions(2030)
            assert abs(end - start) > day, key


def _walked(monkeypatch: pytest.MonkeyPatch) -> list[datetime]:
    """The wall times the fixed-time search reads, as they are read."""
    walked: list[datetime] = []
    fires = cron_module._fires

    def counting(it: CronSim, expression: str) -> Iterator[datetime]:
        for wall in fires(it, expression):
            walked.append(wall)
            yield wall

    monkeypatch.setattr(cron_module, "_fires", counting)
    return walked


@pytest.mark.parametrize("expr", ["0-59 0-23 * * * *", "0-59 0-23 * * *", "0 0-23 * * * */5"])
def test_a_fixed_time_search_away_from_a_change_starts_at_the_instant(
    expr: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seated 3 hours before the instant on every search (for a time skipped by a change
    just before it), ``0-59 0-23 * * * *``, every second, read 10,800 wall times per fire
    time (117 ms: a leader with a few such jobs could not keep up with its ticks). Away from
    a change the search reads the fire time itself and little else."""
    walked = _walked(monkeypatch)
    schedule = CronSchedule(expr, "Europe/Berlin")
    current = datetime(2026, 6, 1, 12, 0, 0, 500_000, tzinfo=UTC)
    for _ in range(20):
        before = len(walked)
        current = schedule.next_after(current)
        assert len(walked) - before <= 2
    reference = CronSchedule(expr, "UTC")  # (a zone without changes: the same cadence)
    start = datetime(2026, 6, 1, 12, 0, 0, 500_000, tzinfo=UTC)
    assert reference.between(start, current, 100)[-1] == current


def _seated_before_the_gap(schedule: CronSchedule, after: datetime) -> datetime:
    """The reference: the first fire time after ``after`` from a search seated _GAP_MAX
    before it, whatever the clock did (the search before it was made cheap)."""
    start = after.astimezone(schedule.zone).replace(tzinfo=None) - cron_module._GAP_MAX
    for wall in cron_module._fires(cron_module._seated(schedule._parsed, start), "x"):
        found = schedule._on_the_clock(wall).astimezone(UTC)
        if found > after:
            return found
    raise AssertionError("unreachable")


@pytest.mark.parametrize(
    ("tz", "change"),
    [
        ("Europe/Berlin", datetime(2026, 3, 29, 1, tzinfo=UTC)),
        ("Europe/Berlin", datetime(2026, 10, 25, 1, tzinfo=UTC)),
        ("America/New_York", datetime(2026, 3, 8, 7, tzinfo=UTC)),
        ("America/New_York", datetime(2026, 11, 1, 6, tzinfo=UTC)),
        ("Australia/Lord_Howe", datetime(2026, 4, 4, 15, tzinfo=UTC)),
        ("Australia/Lord_Howe", datetime(2026, 10, 3, 15, 30, tzinfo=UTC)),
        ("Pacific/Chatham", datetime(2026, 9, 26, 14, tzinfo=UTC)),
    ],
)
@pytest.mark.parametrize("expr", ["30 2 * * * 0,30", "0-59 1-3 * * * */20", "0 1-3 * * *"])
def test_a_fixed_time_search_after_a_change_finds_what_one_from_before_it_does(
    tz: str, change: datetime, expr: str
) -> None:
    """A search starts at its instant's wall time unless the clocks changed within the
    3 hours before it: then from the gap's first wall time (a time skipped fires after the
    gap, at a wall time earlier than the instant's) or past the repeated hour. Every instant
    around a change finds the fire time a search seated 3 hours earlier finds."""
    schedule = CronSchedule(expr, tz)
    seconds = [*range(-3600, 4 * 3600, 613), *range(-3, 125, 7)]
    for offset in seconds:
        after = change + timedelta(seconds=offset)
        assert schedule.next_after(after) == _seated_before_the_gap(schedule, after), after


def test_every_second_of_the_day_fires_once_across_the_changes() -> None:
    """``0-59 0-23 * * * *`` is every second: through a spring change, every real second,
    once (a skipped one fires once after the gap, at a second already due); through an
    autumn change, every second of the first pass and none of the repeated hour's second."""
    schedule = CronSchedule("0-59 0-23 * * * *", "Europe/Berlin")
    spring = datetime(2026, 3, 29, 1, tzinfo=UTC)
    ticks = schedule.between(spring - timedelta(minutes=2), spring + timedelta(minutes=2), 1000)
    assert ticks == [spring - timedelta(minutes=2) + timedelta(seconds=s) for s in range(1, 241)]
    autumn = datetime(2026, 10, 25, 1, tzinfo=UTC)  # (03:00 CEST → 02:00 CET)
    ticks = schedule.between(autumn - timedelta(minutes=1), autumn + timedelta(hours=1), 10_000)
    # (From 01:00 UTC the wall clock reads 02:00:00 to 02:59:59 again: 03:00 is at 02:00 UTC.)
    first = [autumn - timedelta(minutes=1) + timedelta(seconds=s) for s in range(1, 60)]
    assert ticks == [*first, autumn + timedelta(hours=1)]


def _stepped_on_the_clock(zone: ZoneInfo, wall: datetime) -> datetime:
    """The reference for a skipped wall time: stepped a minute at a time until it exists."""
    moment = wall.replace(tzinfo=zone, fold=0)
    while cron_module._is_skipped(moment):
        wall += timedelta(minutes=1)
        moment = wall.replace(tzinfo=zone, fold=0)
    return moment


@pytest.mark.parametrize(
    ("tz", "gap_start", "minutes"),
    [
        ("America/New_York", datetime(2026, 3, 8, 2), 60),
        ("Europe/Berlin", datetime(2026, 3, 29, 2), 60),
        ("Australia/Lord_Howe", datetime(2026, 10, 4, 2), 30),  # (a half-hour change)
        ("Pacific/Apia", datetime(2011, 12, 30), 24 * 60),  # (a whole day skipped)
    ],
)
def test_a_skipped_wall_time_moves_to_the_first_minute_after_the_gap(
    tz: str, gap_start: datetime, minutes: int
) -> None:
    schedule = CronSchedule("* * * * *", tz)
    zone = ZoneInfo(tz)
    for second in range(0, minutes * 60, 997 if minutes > 60 else 1):
        wall = gap_start + timedelta(seconds=second)
        assert cron_module._is_skipped(wall.replace(tzinfo=zone)), wall
        expected = _stepped_on_the_clock(zone, wall)
        assert schedule._on_the_clock(wall) == expected, wall
    after = gap_start + timedelta(minutes=minutes)  # the gap's end exists
    assert schedule._on_the_clock(after) == after.replace(tzinfo=zone)


@pytest.mark.parametrize("expr", ["0-59 0-23 * * * *", "0-59 2 * * * *", "0-59 2 * * * 15,45"])
def test_a_search_in_the_minute_after_a_spring_change_reads_little_of_the_gap(
    expr: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In the last seconds of the minute after a spring change, the search walked the whole
    gap (3,600 wall times of ``0-59 0-23 * * * *``, each stepped a minute at a time to the
    clock: 0.4 s a search, blocking the leader). Nothing in the gap fires later than the
    change plus the expression's last second, so past that the gap is not read; before it,
    the search stops in the gap's first minute."""
    schedule = CronSchedule(expr, "America/New_York")
    change = datetime(2026, 3, 8, 7, tzinfo=UTC)
    # Around the seconds the expressions fire at, and the minute's last ones.
    offsets = [-2, -0.5, 0, 0.5, 1, 14.5, 15, 15.5, 30, 44.5, 45, 45.5, 58.5, 59, 59.5, 60, 61]
    afters = [change + timedelta(seconds=offset) for offset in offsets]
    expected = [_seated_before_the_gap(schedule, after) for after in afters]
    walked = _walked(monkeypatch)
    for after, fire in zip(afters, expected, strict=True):
        before = len(walked)
        assert schedule.next_after(after) == fire, after
        assert len(walked) - before <= 62, after
