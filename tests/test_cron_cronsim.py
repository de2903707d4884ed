"""Property test: Jobplane's fire times agree with cronsim (Debian/Vixie cron semantics) over
random expressions, zones with unusual transitions and start instants near them.

The deliberate differences (see ``CronSchedule``) are excluded here and tested on their own:
fire times are strictly after the start (cronsim, seated in the second pass of a repeated hour,
may return the first pass), and 6-field expressions with a fixed minute and hour follow the
fixed-time rules (cronsim leaves them to the plain instant-by-instant rules).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from cronsim import CronSim, CronSimError

from jobplane.cron import CronSchedule, validate_cron
from jobplane.errors import InvalidOptionsError

ZONES = [
    "Europe/Berlin",
    "America/New_York",
    "Australia/Lord_Howe",  # 30-minute shifts
    "Pacific/Chatham",  # changes at 02:45 / 03:45
    "America/Santiago",  # changes at midnight
    "Asia/Tehran",
    "Pacific/Apia",
    "UTC",
]
#: cronsim moves across a clock change by whole hours: where the shift is half an hour it
#: loses matching instants of expressions not at fixed times (test_cron_dst.py checks those
#: against every instant). There its fire times must be among Jobplane's, and Jobplane's
#: others must match the expression on their own wall clock.
HALF_HOUR_SHIFTS = {"Australia/Lord_Howe"}
FIRES = 6
SEEDS = range(12)
CASES_PER_SEED = 150


def transitions(zone: ZoneInfo, year: int) -> list[datetime]:
    """The UTC instants at which ``zone``'s offset changes during ``year`` (hour precision)."""
    out = []
    at = datetime(year, 1, 1, tzinfo=UTC)
    previous = at.astimezone(zone).utcoffset()
    while at.year == year:
        at += timedelta(hours=1)
        offset = at.astimezone(zone).utcoffset()
        if offset != previous:
            out.append(at)
            previous = offset
    return out


TRANSITIONS = {name: transitions(ZoneInfo(name), 2026) for name in ZONES}


def _field(rng: random.Random, low: int, high: int) -> str:
    kind = rng.randrange(7)
    a, b = sorted(rng.sample(range(low, high + 1), 2))
    if kind == 0:
        return "*"
    if kind == 1:
        return str(a)
    if kind == 2:
        return f"{a}-{b}"
    if kind == 3:
        return ",".join(str(v) for v in sorted(set(rng.sample(range(low, high + 1), 3))))
    if kind == 4:
        return f"*/{rng.randint(2, max(2, (high - low) // 2))}"
    if kind == 5:
        return f"{a}-{b}/{rng.randint(2, 4)}"
    return f"{a}/{rng.randint(2, 5)}"


def _day_of_week(rng: random.Random) -> str:
    kind = rng.randrange(6)
    if kind == 0:
        return f"{rng.randint(0, 6)}#{rng.randint(1, 5)}"
    if kind == 1:
        return f"{rng.randint(0, 6)}L"
    if kind == 2:
        return rng.choice(["MON-FRI", "SAT,SUN", "*"])
    return _field(rng, 0, 6)


def _day_of_month(rng: random.Random) -> str:
    return rng.choice(["L", "LW", "*", "*", _field(rng, 1, 28), _field(rng, 1, 31)])


def expression(rng: random.Random) -> str:
    minute = rng.choice(["0", "30", _field(rng, 0, 59)])
    hour = rng.choice(["*", "2", "1-3", _field(rng, 0, 23)])
    month = rng.choice(["*", "*", _field(rng, 1, 12)])
    return f"{minute} {hour} {_day_of_month(rng)} {month} {_day_of_week(rng)}"


def start_instant(rng: random.Random, zone: str) -> datetime:
    near = TRANSITIONS[zone]
    if near and rng.random() < 0.8:
        base = rng.choice(near)
        return base + timedelta(seconds=rng.randint(-4 * 3600, 4 * 3600))
    return datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=rng.randint(0, 365 * 86400))


def reference(expr: str, zone: str, start: datetime) -> Iterator[datetime]:
    """cronsim's fire times from ``start`` in UTC, strictly increasing and after ``start``."""
    latest = start
    for fire in CronSim(expr, start.astimezone(ZoneInfo(zone))):
        at = fire.astimezone(UTC)
        if at > latest:
            latest = at
            yield at


def _on_their_wall_clock(expr: str, zone: str, fires: list[datetime]) -> bool:
    """Whether each fire time's wall time, at its own offset, matches ``expr``."""
    walls = [at.astimezone(ZoneInfo(zone)).replace(tzinfo=None) for at in fires]
    return all(next(CronSim(expr, wall - timedelta(seconds=1))) == wall for wall in walls)


def ours(expr: str, zone: str, start: datetime) -> Iterator[datetime]:
    schedule = CronSchedule(expr, zone)
    current = start
    while True:
        current = schedule.next_after(current)
        yield current


def cases(seed: int) -> Iterator[tuple[str, str, datetime]]:
    rng = random.Random(seed)
    for _ in range(CASES_PER_SEED):
        zone = rng.choice(ZONES)
        yield expression(rng), zone, start_instant(rng, zone)


@pytest.mark.parametrize("seed", SEEDS)
def test_fire_times_match_cronsim(seed: int) -> None:
    compared = 0
    for expr, zone, start in cases(seed):
        try:
            expected = list(itertools.islice(reference(expr, zone, start), FIRES))
        except CronSimError:
            with pytest.raises(InvalidOptionsError):
                validate_cron(expr)
            continue
        if len(expected) < FIRES:  # cronsim found nothing within 50 years
            with pytest.raises(InvalidOptionsError, match="never fires"):
                validate_cron(expr)
            continue
        got = list(itertools.islice(ours(expr, zone, start), FIRES))
        what = f"{expr!r} in {zone} from {start.isoformat()}"
        minute, hour = expr.split()[:2]
        if zone in HALF_HOUR_SHIFTS and (minute.startswith("*") or hour.startswith("*")):
            upto = min(got[-1], expected[-1])
            mine = [at for at in got if at <= upto]
            assert {at for at in expected if at <= upto} <= set(mine), what
            assert _on_their_wall_clock(expr, zone, mine), what
        else:
            assert got == expected, what
        compared += 1
    assert compared >= CASES_PER_SEED // 2  # the generator mostly makes expressions that fire


@pytest.mark.parametrize(
    ("expr", "zone"),
    [("*/20 * * * * 30", "Australia/Lord_Howe"), ("0 * * * * */15", "Europe/Berlin")],
)
def test_six_fields_with_a_wildcard_match_cronsim(expr: str, zone: str) -> None:
    seconds_first = " ".join([expr.split()[5], *expr.split()[:5]])
    for start in TRANSITIONS[zone]:
        start -= timedelta(hours=1)
        expected = list(itertools.islice(reference(seconds_first, zone, start), 20))
        assert list(itertools.islice(ours(expr, zone, start), 20)) == expected


def test_six_fields_at_fixed_times_follow_the_fixed_time_rules() -> None:
    """A deliberate difference: cronsim skips 02:30:10 in spring and fires it twice in autumn
    for a 6-field expression; Jobplane fires it once, as for 5 fields."""
    berlin = ZoneInfo("Europe/Berlin")
    spring = list(
        itertools.islice(
            ours(
                "30 2 * * * 10",
                "Europe/Berlin",
                TRANSITIONS["Europe/Berlin"][0] - timedelta(hours=2),
            ),
            2,
        )
    )
    assert [t.astimezone(berlin).strftime("%d %H:%M:%S%z") for t in spring] == [
        "29 03:00:10+0200",
        "30 02:30:10+0200",
    ]
    autumn = list(
        itertools.islice(
            ours(
                "30 2 * * * 10",
                "Europe/Berlin",
                TRANSITIONS["Europe/Berlin"][1] - timedelta(hours=2),
            ),
            2,
        )
    )
    assert [t.astimezone(berlin).strftime("%d %H:%M:%S%z") for t in autumn] == [
        "25 02:30:10+0200",
        "26 02:30:10+0100",
    ]


def test_fire_times_are_strictly_after_the_start_in_a_repeated_hour() -> None:
    """A deliberate difference: seated in the second pass of Berlin's repeated hour, cronsim
    returns 02:30 of the first pass (earlier than the start); Jobplane returns the next day's."""
    berlin = ZoneInfo("Europe/Berlin")
    second_pass = datetime(2026, 10, 25, 2, 10, tzinfo=berlin).replace(fold=1)
    start = second_pass.astimezone(UTC)
    cronsim_first = next(CronSim("30 2 * * *", second_pass)).astimezone(UTC)
    assert cronsim_first < start
    assert CronSchedule("30 2 * * *", "Europe/Berlin").next_after(start) == datetime(
        2026, 10, 26, 2, 30, tzinfo=berlin
    ).astimezone(UTC)


def test_a_step_in_day_of_week_restricts_the_day_of_month() -> None:
    """`*/2` starts with `*`: the 1st and the 15th, when they are a Sunday, Tuesday, Thursday
    or Saturday (AND), not every other weekday (OR)."""
    start = datetime(2026, 1, 1, tzinfo=UTC)
    got = list(itertools.islice(ours("0 0 1,15 * */2", "UTC", start), 6))
    assert all(t.day in (1, 15) and t.isoweekday() % 7 in (0, 2, 4, 6) for t in got)
    assert got[0] == datetime(2026, 1, 15, tzinfo=UTC)  # a Thursday; the 1st was too, but not after


@pytest.mark.parametrize(
    "expr", ["0 0 30 2 *", "0 0 31 4,6,9,11 *", "0 0 30 2 * 5", "0 0 */20 * 1#5"]
)
def test_expressions_that_never_fire_are_refused(expr: str) -> None:
    with pytest.raises(InvalidOptionsError) as raised:
        validate_cron(expr)
    assert raised.value.field == "cron"


def test_rare_expressions_that_do_fire_are_accepted() -> None:
    # A fifth Monday in February exists only in some leap years; the 1st OR a fifth Monday.
    assert validate_cron("0 0 * 2 1#5") == "0 0 * 2 1#5"
    assert validate_cron("0 0 1 * 1#5") == "0 0 1 * 1#5"
