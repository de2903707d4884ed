"""Misfire policies: what a new leader makes of the ticks missed while none ran."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from jobplane.domain.models import InstanceSource, JobDefinition
from jobplane.domain.options import JobOptions
from jobplane_scheduler.cron_timers import CronTimers, catch_up

T0 = datetime(2026, 5, 1, 12, 0, 0, tzinfo=UTC)


def job(**options: object) -> JobDefinition:
    parsed = JobOptions.parse(key="tick", kind="recurring", cron="* * * * * *", **options)
    return JobDefinition(options=parsed, version=1)


def test_fire_once_fires_the_latest_and_records_the_rest() -> None:
    made = catch_up(job(), T0, T0 + timedelta(seconds=5))
    fired = [m for m in made if m.skip_reason is None]
    skipped = [m for m in made if m.skip_reason == "misfire"]
    assert [m.scheduled_at for m in fired] == [T0 + timedelta(seconds=5)]
    assert [m.scheduled_at for m in skipped] == [T0 + timedelta(seconds=s) for s in range(1, 5)]
    assert all(m.source is InstanceSource.CRON for m in made)


def test_fire_all_fires_every_missed_tick() -> None:
    made = catch_up(job(misfire="fire_all"), T0, T0 + timedelta(seconds=3))
    assert [m.skip_reason for m in made] == [None, None, None]


def test_skip_records_every_missed_tick() -> None:
    made = catch_up(job(misfire="skip"), T0, T0 + timedelta(seconds=3))
    assert [m.skip_reason for m in made] == ["misfire"] * 3


def test_misfire_max_bounds_the_records_to_the_latest_ticks() -> None:
    made = catch_up(job(misfire="skip", misfire_max=10), T0, T0 + timedelta(seconds=100))
    assert len(made) == 10
    assert made[-1].scheduled_at == T0 + timedelta(seconds=100)


def test_a_long_outage_yields_the_latest_ticks_exactly() -> None:
    # A day of one-second ticks (86,400) bounded to the latest 10: found from the end.
    made = catch_up(job(misfire_max=10), T0, T0 + timedelta(days=1, milliseconds=500))
    end = T0 + timedelta(days=1)
    assert [m.scheduled_at for m in made] == [end - timedelta(seconds=s) for s in range(9, -1, -1)]
    assert [m.skip_reason for m in made] == ["misfire"] * 9 + [None]
    # An uneven cadence (weekdays at 09:00-09:02): the latest 5 lie across a weekend.
    weekdays = JobOptions.parse(
        key="tick", kind="recurring", cron="0-2 9 * * 1-5", misfire="skip", misfire_max=5
    )
    friday_night = datetime(2026, 5, 8, 22, tzinfo=UTC)  # a Friday
    made = catch_up(JobDefinition(options=weekdays, version=1), T0, friday_night)
    assert [m.scheduled_at.strftime("%a %H:%M") for m in made] == [
        "Thu 09:01",
        "Thu 09:02",
        "Fri 09:00",
        "Fri 09:01",
        "Fri 09:02",
    ]


def test_nothing_missed_and_never_fired() -> None:
    assert catch_up(job(), T0, T0) == []
    assert catch_up(job(), None, T0 + timedelta(days=1)) == []  # a new job starts from now


def test_timers_continue_from_the_last_occurrence() -> None:
    timers = CronTimers()
    timers.set_job(job(), T0, T0 + timedelta(hours=1))
    assert timers.next_time() == T0 + timedelta(seconds=1)
    due = timers.pop_due(T0 + timedelta(seconds=1))
    assert due == [("tick", T0 + timedelta(seconds=1))]
    timers.advance("tick", T0 + timedelta(seconds=1))
    assert timers.next_time() == T0 + timedelta(seconds=2)
    # A new version of the definition replaces the old entry; a paused job has none.
    paused = JobDefinition(options=job().options, version=2, paused=True)
    timers.set_job(paused, T0, T0)
    assert timers.next_time() is None


def test_end_at_stops_the_timer() -> None:
    timers = CronTimers()
    timers.set_job(job(end_at=T0 + timedelta(seconds=1, milliseconds=500)), T0, T0)
    [(_, at)] = timers.pop_due(T0 + timedelta(seconds=1))
    timers.advance("tick", at)
    assert timers.next_time() is None


def test_a_replan_past_end_at_queues_nothing() -> None:
    # Every re-plan (new leader, edit, resume) goes through set_job: whether the job's last
    # tick was at end_at or it never fired, no tick after end_at is queued.
    ended = job(end_at=T0)
    for last in (T0, None):
        timers = CronTimers()
        timers.set_job(ended, last, T0 + timedelta(seconds=30))
        assert timers.next_time() is None, last
    # The tick exactly at end_at is still planned (end is inclusive).
    timers = CronTimers()
    timers.set_job(ended, T0 - timedelta(seconds=1), T0 - timedelta(milliseconds=500))
    assert timers.next_time() == T0
    # A catch-up 30 s after end_at fires the tick at end_at, nothing later.
    made = catch_up(ended, T0 - timedelta(seconds=5), T0 + timedelta(seconds=30))
    assert [m.scheduled_at for m in made if m.skip_reason is None] == [T0]
    assert max(m.scheduled_at for m in made if m.scheduled_at) == T0


def test_start_at_is_inclusive() -> None:
    start = T0 + timedelta(seconds=10)
    starting = job(start_at=start)
    timers = CronTimers()
    timers.set_job(starting, None, T0)
    assert timers.next_time() == start
    # Also when the job has fired before and start_at was moved later by an edit.
    timers.set_job(starting, T0 - timedelta(hours=1), T0)
    assert timers.next_time() == start
    # A daily job starting exactly on one of its ticks fires that tick.
    daily = JobDefinition(
        options=JobOptions.parse(key="d", kind="recurring", cron="0 12 * * *", start_at=T0),
        version=1,
    )
    timers.set_job(daily, None, T0 - timedelta(days=3))
    assert timers.next_time() == T0


def test_catch_up_stays_inside_start_at() -> None:
    start = T0 + timedelta(seconds=10)
    # Before start_at nothing was missed; from start_at on (inclusive) it was.
    assert catch_up(job(start_at=start, misfire="skip"), T0, T0 + timedelta(seconds=5)) == []
    made = catch_up(job(start_at=start, misfire="skip"), T0, start + timedelta(seconds=2))
    assert [m.scheduled_at for m in made] == [start + timedelta(seconds=s) for s in range(3)]
