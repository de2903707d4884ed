"""Misfire policies: what a new leader makes of the ticks missed while none ran."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from jobplane.domain.models import InstanceSource, JobDefinition, NewInstance
from jobplane.domain.options import MISFIRE_MAX, JobOptions
from jobplane.errors import InvalidOptionsError
from jobplane_scheduler.cron_timers import BACKFILL_BATCH, CronTimers, catch_up

T0 = datetime(2026, 5, 1, 12, 0, 0, tzinfo=UTC)


def job(**options: object) -> JobDefinition:
    """A one-second job; with no grace every tick before "now" is missed (policy tests). (A
    grace under MISFIRE_GRACE_MIN is refused for a new definition; read back as stored.)"""
    options.setdefault("misfire_grace_s", 0)
    values = {"key": "tick", "kind": "recurring", "cron": "* * * * * *", **options}
    return JobDefinition(options=JobOptions.from_stored(values), version=1)


def records(definition: JobDefinition, last: datetime | None, now: datetime) -> list[NewInstance]:
    """One catch-up pass that must reach the present. The leader looks a millisecond after
    ``now``, so with no grace a tick at ``now`` is (just) late too."""
    caught = catch_up(definition, last, now + timedelta(milliseconds=1))
    assert caught.complete
    return caught.records


def all_passes(definition: JobDefinition, last: datetime, now: datetime) -> list[list[NewInstance]]:
    """Catch-up passes as the leader runs them: each from the latest tick recorded before."""
    passes = []
    while True:
        caught = catch_up(definition, last, now)
        passes.append(caught.records)
        if caught.complete:
            return passes
        last = max(m.scheduled_at for m in caught.records if m.scheduled_at)


def test_fire_once_fires_the_latest_and_records_the_rest() -> None:
    made = records(job(), T0, T0 + timedelta(seconds=5))
    fired = [m for m in made if m.skip_reason is None]
    skipped = [m for m in made if m.skip_reason == "misfire"]
    assert [m.scheduled_at for m in fired] == [T0 + timedelta(seconds=5)]
    assert [m.scheduled_at for m in skipped] == [T0 + timedelta(seconds=s) for s in range(1, 5)]
    assert all(m.source is InstanceSource.CRON for m in made)


def test_fire_all_fires_every_missed_tick() -> None:
    made = records(job(misfire="fire_all"), T0, T0 + timedelta(seconds=3))
    assert [m.skip_reason for m in made] == [None, None, None]


def test_skip_records_every_missed_tick() -> None:
    made = records(job(misfire="skip"), T0, T0 + timedelta(seconds=3))
    assert [m.skip_reason for m in made] == ["misfire"] * 3


def test_ticks_beyond_misfire_max_are_recorded_skipped() -> None:
    # fire_all fires the latest misfire_max ticks; the older ones are recorded, not dropped.
    made = records(job(misfire="fire_all", misfire_max=10), T0, T0 + timedelta(seconds=100))
    assert [m.scheduled_at for m in made] == [T0 + timedelta(seconds=s) for s in range(1, 101)]
    assert [m.skip_reason for m in made] == ["misfire"] * 90 + [None] * 10


def test_a_long_outage_is_recorded_in_bounded_passes() -> None:
    # Two hours of one-second ticks (7,200): the first passes record the oldest ticks Skipped,
    # BACKFILL_BATCH at a time; the last applies the policy to the latest misfire_max.
    end = T0 + timedelta(hours=2)
    passes = all_passes(job(misfire_max=10), T0, end + timedelta(milliseconds=500))
    assert all(len(p) == BACKFILL_BATCH for p in passes[:-1])
    assert len(passes) == 7_200 // BACKFILL_BATCH + 1
    made = [m for p in passes for m in p]
    assert [m.scheduled_at for m in made] == [T0 + timedelta(seconds=s) for s in range(1, 7_201)]
    assert [m.skip_reason for m in made] == ["misfire"] * 7_199 + [None]
    assert passes[-1][-1].scheduled_at == end
    # An uneven cadence (weekdays at 09:00-09:02) over a week: every tick, fire_once.
    weekdays = JobOptions.from_stored(
        {
            "key": "tick",
            "kind": "recurring",
            "cron": "0-2 9 * * 1-5",
            "misfire": "skip",
            "misfire_max": 5,
            "misfire_grace_s": 0,
        }
    )
    friday_night = datetime(2026, 5, 8, 22, tzinfo=UTC)  # a Friday
    made = records(JobDefinition(options=weekdays, version=1), T0, friday_night)
    assert len(made) == 15  # Mon-Fri (T0 is a Friday at noon: from Monday the 4th)
    assert [f"{m.scheduled_at:%a %H:%M}" for m in made[-5:]] == [
        "Thu 09:01",
        "Thu 09:02",
        "Fri 09:00",
        "Fri 09:01",
        "Fri 09:02",
    ]


@pytest.mark.parametrize("policy", ["fire_once", "skip"])
def test_a_pass_of_fire_once_or_skip_writes_a_batch_whatever_misfire_max(policy: str) -> None:
    # Their outcome does not depend on the bound (the latest tick fires, or none does), so
    # a pass computes a batch and one more tick. Under misfire_max + BACKFILL_BATCH ticks,
    # every one was computed and written in one pass (here 7,200: one statement).
    end = T0 + timedelta(hours=2)
    just_after = end + timedelta(milliseconds=1)
    passes = all_passes(job(misfire=policy, misfire_max=MISFIRE_MAX), T0, just_after)
    assert [len(p) for p in passes] == [BACKFILL_BATCH] * 14 + [200]
    made = [m for p in passes for m in p]
    assert [m.scheduled_at for m in made] == [T0 + timedelta(seconds=s) for s in range(1, 7_201)]
    fired = [m.scheduled_at for m in made if m.skip_reason is None]
    assert fired == ([end] if policy == "fire_once" else [])


def test_misfire_max_is_at_most_ten_thousand_and_a_larger_stored_one_applies_as_that() -> None:
    with pytest.raises(InvalidOptionsError) as refused:
        JobOptions.parse(
            key="tick", kind="recurring", cron="* * * * * *", misfire_max=MISFIRE_MAX + 1
        )
    assert refused.value.field == "misfire_max"
    # Stored by an earlier version: read back as it is, applied as MISFIRE_MAX. Every pass
    # computed 100,000 ticks (1.7 s of the leader's loop here), and fired 10,800 at once.
    stored = JobOptions.from_stored(
        {**job(misfire="fire_all").options.model_dump(), "misfire_max": 100_000}
    )
    assert stored.misfire_max == 100_000
    just_after = T0 + timedelta(hours=3, milliseconds=1)
    passes = all_passes(JobDefinition(options=stored, version=1), T0, just_after)
    assert [len(p) for p in passes] == [BACKFILL_BATCH, MISFIRE_MAX + 300]
    made = [m for p in passes for m in p]
    assert [m.skip_reason for m in made] == ["misfire"] * 800 + [None] * MISFIRE_MAX


def test_nothing_missed_and_never_fired() -> None:
    assert records(job(), T0, T0) == []
    assert records(job(), None, T0 + timedelta(days=1)) == []  # a new job starts from now


def test_a_job_that_never_fired_catches_up_from_when_its_schedule_began() -> None:
    # A re-plan of a never-fired job (no occurrence to read) just after its first tick was
    # due, before the tick was written: the tick is on time (within the grace) and fires.
    start = T0 + timedelta(seconds=10)
    made = job(start_at=start, misfire_grace_s=5).options
    created = JobDefinition(options=made, version=1, created_at=T0)
    fired = records(created, None, start + timedelta(milliseconds=500))
    assert [(m.scheduled_at, m.skip_reason) for m in fired] == [(start, None)]
    # Without start_at: from its creation; after an edit of its schedule: from the edit.
    plain = JobDefinition(options=job(misfire_grace_s=5).options, version=1, created_at=T0)
    assert [m.scheduled_at for m in records(plain, None, T0 + timedelta(seconds=2))] == [
        T0 + timedelta(seconds=1),
        T0 + timedelta(seconds=2),
    ]
    edited = JobDefinition(
        options=plain.options,
        version=2,
        created_at=T0 - timedelta(days=1),
        schedule_since=T0 + timedelta(milliseconds=500),
    )
    assert [m.scheduled_at for m in records(edited, None, T0 + timedelta(seconds=1))] == [
        T0 + timedelta(seconds=1)
    ]
    # The ticks missed beyond the grace follow the policy, as after any outage.
    late = JobDefinition(options=job(misfire="skip").options, version=1, created_at=T0)
    assert {m.skip_reason for m in records(late, None, T0 + timedelta(seconds=3))} == {"misfire"}


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


def test_the_ticks_due_at_a_time_are_known_before_it_without_popping_them() -> None:
    """What the leader builds ahead of a tick is exactly what it pops at the tick: the same
    (job, tick) pairs in the same order, re-planned jobs as re-planned."""
    timers = CronTimers()
    for i in range(50):
        options = JobOptions.parse(
            key=f"j{i:02d}", kind="recurring", cron=f"* * * * * */{1 + i % 3}"
        )
        timers.set_job(JobDefinition(options=options, version=1), T0, T0)
    replanned = JobOptions.parse(key="j07", kind="recurring", cron="* * * * * */5")
    timers.set_job(JobDefinition(options=replanned, version=2), T0, T0)  # its old entry is stale
    timers.drop_job("j08")
    for seconds in (1, 2, 3, 4, 5, 6):
        at = T0 + timedelta(seconds=seconds)
        ahead = timers.due_at(at)
        assert ahead == timers.due_at(at)  # left in place
        due = timers.pop_due(at)
        assert ahead == due and due
        assert all(key != "j08" for key, _ in due)
        assert ("j07", at) in due if seconds == 5 else all(key != "j07" for key, _ in due)
        for key, tick in due:
            timers.advance(key, tick)


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
    made = records(ended, T0 - timedelta(seconds=5), T0 + timedelta(seconds=30))
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
    assert records(job(start_at=start, misfire="skip"), T0, T0 + timedelta(seconds=5)) == []
    made = records(job(start_at=start, misfire="skip"), T0, start + timedelta(seconds=2))
    assert [m.scheduled_at for m in made] == [start + timedelta(seconds=s) for s in range(3)]


def test_ticks_within_the_misfire_grace_fire_whatever_the_policy() -> None:
    # Grace 2 s, 5 s behind: ticks at most 2 s late fire; the older ones follow the policy.
    now = T0 + timedelta(seconds=5) - timedelta(milliseconds=1)
    made = records(job(misfire="skip", misfire_grace_s=2), T0, now)
    assert [(m.scheduled_at, m.skip_reason) for m in made] == [
        (T0 + timedelta(seconds=1), "misfire"),
        (T0 + timedelta(seconds=2), "misfire"),
        (T0 + timedelta(seconds=3), None),
        (T0 + timedelta(seconds=4), None),
        (T0 + timedelta(seconds=5), None),
    ]
    made = records(job(misfire="fire_once", misfire_grace_s=2), T0, now)
    assert [m.skip_reason for m in made] == ["misfire", None, None, None, None]
    # Nothing later than the grace: every tick fires, nothing is recorded Skipped.
    made = records(job(misfire="skip", misfire_grace_s=10), T0, now)
    assert [m.skip_reason for m in made] == [None] * 5


def test_a_grace_below_the_leaders_lag_is_refused_but_read_back_if_stored() -> None:
    """At 0 every tick was late by the time the leader fired it (a few milliseconds): with
    ``skip`` a healthy leader recorded every tick Skipped, and the job never ran."""
    with pytest.raises(InvalidOptionsError) as info:
        JobOptions.parse(key="tick", kind="recurring", cron="* * * * *", misfire_grace_s=0.1)
    assert info.value.field == "misfire_grace_s"
    assert JobOptions.parse(key="t", kind="recurring", cron="* * * * *", misfire_grace_s=0.5)
    assert job(misfire_grace_s=0).options.misfire_grace_s == 0
