"""The leader's cron bookkeeping: which tick of which job is due next, and what a misfire
policy makes of the ticks missed while no leader ran.

Pure logic over definitions and recorded occurrences; the leader does the I/O.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import NamedTuple

from jobplane.cron import JUST_BEFORE, CronSchedule, search_from
from jobplane.domain.models import DefinitionVersion, InstanceSource, JobDefinition, NewInstance
from jobplane.domain.options import MISFIRE_MAX, MisfirePolicy
from jobplane.domain.reasons import EndReason

logger = logging.getLogger(__name__)

#: Missed ticks beyond ``misfire_max`` recorded Skipped per catch-up pass (one statement).
BACKFILL_BATCH = 500
#: At most this many ticks within a job's misfire grace are fired by one catch-up pass.
ON_TIME_MAX = 10_000


class _Entry(NamedTuple):
    # A tuple, compared in C: a heap of 1,000 one-second jobs pops a whole tick at once, and
    # a dataclass's ordering cost 4 ms of that tick's lag (a tuple: 1 ms).
    at: datetime
    key: str
    plan: int  # which set_job planned it; older plans are discarded (equal ticks: any order)


@dataclass
class CronTimers:
    """A heap of the next fire time of every active recurring job."""

    _heap: list[_Entry] = field(default_factory=list)
    _schedules: dict[str, tuple[int, CronSchedule, JobDefinition]] = field(default_factory=dict)
    _plans: int = 0

    def set_job(self, definition: JobDefinition, last: datetime | None, now: datetime) -> None:
        """(Re)schedule a job from its last recorded occurrence (never from "now", so a new
        leader continues exactly where the old one stopped)."""
        options = definition.options
        if not is_active(definition):
            self._schedules.pop(definition.key, None)
            return
        assert options.cron is not None
        schedule = CronSchedule(options.cron, options.timezone)
        # A new plan number per call: re-planning a job (edit, catch-up, event and sweep both
        # seeing the same change) leaves one live entry, never two that would fire a tick twice.
        self._plans += 1
        self._schedules[definition.key] = (self._plans, schedule, definition)
        nxt = schedule.next_after(search_from(options.start_at, last or now))
        # Every re-plan (new leader, edit, resume, bus restart) comes through here, so the
        # window is checked here too: a job past its end_at gets no entry at all.
        if options.end_at is not None and nxt > options.end_at:
            return
        heapq.heappush(self._heap, _Entry(nxt, definition.key, self._plans))

    def drop_job(self, key: str) -> None:
        self._schedules.pop(key, None)

    def next_time(self) -> datetime | None:
        self._discard_stale()
        return self._heap[0].at if self._heap else None

    def pop_due(self, now: datetime) -> list[tuple[str, datetime]]:
        """Every (job key, tick) due at ``now``; the caller records them, then calls
        :meth:`advance` for each."""
        due: list[tuple[str, datetime]] = []
        while True:
            self._discard_stale()
            if not self._heap or self._heap[0].at > now:
                return due
            entry = heapq.heappop(self._heap)
            due.append((entry.key, entry.at))

    def due_at(self, at: datetime) -> list[tuple[str, datetime]]:
        """What :meth:`pop_due` would return at ``at``, in the same order, left in place."""
        found: list[_Entry] = []
        stack = [0] if self._heap else []
        while stack:
            i = stack.pop()
            entry = self._heap[i]
            if entry.at > at:
                continue  # (its children are later still)
            current = self._schedules.get(entry.key)
            if current is not None and current[0] == entry.plan:
                found.append(entry)
            stack.extend(c for c in (2 * i + 1, 2 * i + 2) if c < len(self._heap))
        return [(e.key, e.at) for e in sorted(found)]

    def advance(self, key: str, fired_at: datetime) -> None:
        found = self._schedules.get(key)
        if found is None:
            return
        plan, schedule, definition = found
        nxt = schedule.next_after(fired_at)
        end = definition.options.end_at
        if end is not None and nxt > end:
            return
        heapq.heappush(self._heap, _Entry(nxt, key, plan))

    def _discard_stale(self) -> None:
        # Entries of a dropped job or of an older plan of it are skipped.
        while self._heap:
            top = self._heap[0]
            current = self._schedules.get(top.key)
            if current is not None and current[0] == top.plan:
                return
            heapq.heappop(self._heap)


def is_active(definition: JobDefinition) -> bool:
    options = definition.options
    return bool(options.cron) and not definition.paused and not options.disabled


@dataclass(frozen=True, slots=True)
class Span:
    """A stretch of a job's timeline under one version of its schedule: its ticks in
    ``(after, until]`` (open-ended where None), within that version's ``[start_at, end_at]``."""

    schedule: CronSchedule
    start_at: datetime | None
    end_at: datetime | None
    after: datetime | None
    until: datetime | None
    #: An earlier version's schedule that no longer computes (an expression that never fires
    #: again) has no more ticks; the current one's error is the job's (see _schedule_failed).
    earlier: bool = False

    def between(self, after: datetime, until: datetime, limit: int) -> list[datetime]:
        """Its ticks in ``(after, until]``, at most ``limit`` (the earliest ones)."""
        lo = search_from(self.start_at, after if self.after is None else max(after, self.after))
        hi = min(t for t in (until, self.until, self.end_at) if t is not None)
        if hi <= lo or limit <= 0:
            return []
        try:
            return self.schedule.between(lo, hi, limit)
        except Exception:
            if not self.earlier:
                raise
            logger.warning(
                "an earlier schedule (%r) cannot be computed; its missed ticks are not recorded",
                self.schedule.expression,
                exc_info=True,
                extra={"action": "scheduler.earlier_schedule_error"},
            )
            return []


def _between(spans: Sequence[Span], after: datetime, until: datetime, limit: int) -> list[datetime]:
    """The ticks of consecutive spans in ``(after, until]``, at most ``limit``, oldest first."""
    out: list[datetime] = []
    for span in spans:
        out += span.between(after, until, limit - len(out))
    return out


def earlier_spans(versions: Sequence[DefinitionVersion], since: datetime) -> list[Span]:
    """The stretches of a job's timeline before its schedule was last edited (at ``since``):
    one per version saved before that edit (``versions``, oldest first: see
    :meth:`~jobplane.store.abc.LeaderStore.schedule_histories`), each from its save to the
    next one's, the first open at its start. Ticks due under them and missed (the leader down,
    or the job paused, across the edit) are missed ticks like any other."""
    before = [v for v in versions if v.at < since]
    spans = []
    for i, version in enumerate(before):
        options = version.options
        if options.cron is None:
            continue
        try:
            schedule = CronSchedule(options.cron, options.timezone)
        except Exception:
            # An expression or zone a later release refuses: logged, and never keeps the
            # current schedule from firing.
            logger.warning(
                "job %s: version %d's schedule cannot be computed; its missed ticks are not "
                "recorded",
                version.key,
                version.version,
                exc_info=True,
                extra={"action": "scheduler.earlier_schedule_error", "job_key": version.key},
            )
            continue
        until = before[i + 1].at if i + 1 < len(before) else since
        after = version.at if i else None
        spans.append(Span(schedule, options.start_at, options.end_at, after, until, True))
    return spans


@dataclass(frozen=True, slots=True)
class CatchUp:
    """One catch-up pass: the records to write, and whether they reach the present."""

    records: list[NewInstance]
    #: False when only the oldest missed ticks are in ``records`` (a backfill batch): write
    #: them, then call :func:`catch_up` again from the latest one.
    complete: bool = True


def catch_up(
    definition: JobDefinition,
    last: datetime | None,
    now: datetime,
    earlier: Sequence[Span] = (),
) -> CatchUp:
    """What the misfire policy makes of the ticks in ``(last, now]`` missed while no leader ran,
    while the job was paused, or while a sitting leader fell behind: fired instances and
    Skipped records (reason "misfire"). A tick at most the job's ``misfire_grace_s`` late is
    not missed: it fires.

    The current schedule's ticks exist from its last edit (``schedule_since``) on; those due
    before it under the schedules it replaced are in ``earlier`` (:func:`earlier_spans`), and
    the policy applies to them as to the others.

    The policy applies to the latest ``misfire_max`` missed ticks (at most
    :data:`~jobplane.domain.options.MISFIRE_MAX`). Every older one is recorded Skipped too
    (nothing vanishes silently), but in bounded passes: when more than ``misfire_max +
    BACKFILL_BATCH`` ticks were missed (``fire_once`` and ``skip``, whose outcome the bound does
    not change: more than ``BACKFILL_BATCH + 1``), the pass records only the oldest
    ``BACKFILL_BATCH`` and is not ``complete``; the leader writes them and calls again, from
    the latest recorded tick. Work per pass is bounded, and the record stays gap-free even if
    the leader dies between passes (the next one continues from what is recorded). A day-long
    outage of a one-second job is 86,400 Skipped rows written in ~170 passes.
    """
    options = definition.options
    if last is None:
        # Never fired: its ticks exist from when its schedule did (the job made, or its
        # schedule last edited), not from "now". A re-plan that reads no occurrence while the
        # first tick is due but not yet written (the tick at start_at, with an edit event and
        # the sweep both re-planning) would otherwise plan past that tick and lose it silently.
        last = definition.created_at or definition.schedule_since
    if last is None or not is_active(definition) or options.cron is None:
        return CatchUp([])
    # Nothing before start_at, after end_at, or before the schedule's edit was missed.
    current = Span(
        CronSchedule(options.cron, options.timezone),
        options.start_at,
        options.end_at,
        definition.schedule_since,
        None,
    )
    spans, until = [*earlier, current], now
    if until <= last:
        return CatchUp([])
    # Ticks at most ``misfire_grace_s`` late are on time: they fire, whatever the policy.
    # (A tick exactly ``misfire_grace_s`` late is on time: the late ones end just before.)
    late_until = min(until, now - timedelta(seconds=options.misfire_grace_s) - JUST_BEFORE)
    on_time = [
        _occurrence(definition.key, at, None)
        for at in _between(spans, max(last, late_until), until, ON_TIME_MAX)
    ]
    if late_until <= last:
        return CatchUp(on_time)
    # Only fire_all needs to know which are the latest misfire_max: fire_once fires the latest
    # tick and skip none, whatever the bound, so a pass of theirs computes a batch and one more
    # tick, not misfire_max of them (a large bound made every pass of a long outage compute
    # that many ticks, for BACKFILL_BATCH written). A bound stored before MISFIRE_MAX is capped.
    fire_all = options.misfire is MisfirePolicy.FIRE_ALL
    bound = min(options.misfire_max, MISFIRE_MAX) if fire_all else 1
    missed = _between(spans, last, late_until, bound + BACKFILL_BATCH)
    if len(missed) >= bound + BACKFILL_BATCH:
        # Possibly many more: record a batch of the oldest ones, Skipped, and come back.
        logger.info(
            "job %s missed more than %d ticks; recording them Skipped in batches",
            definition.key,
            bound + BACKFILL_BATCH,
            extra={"action": "scheduler.misfire_backfill", "job_key": definition.key},
        )
        batch = missed[:BACKFILL_BATCH]
        return CatchUp([_occurrence(definition.key, at, EndReason.MISFIRE) for at in batch], False)
    older, missed = missed[:-bound], missed[-bound:]
    if fire_all:
        fire, skip = missed, []
    elif options.misfire is MisfirePolicy.FIRE_ONCE:
        fire, skip = missed[-1:], missed[:-1]
    else:
        fire, skip = [], missed
    return CatchUp(
        [_occurrence(definition.key, at, EndReason.MISFIRE) for at in older + skip]
        + [_occurrence(definition.key, at, None) for at in fire]
        + on_time
    )


def _occurrence(key: str, at: datetime, skip_reason: str | None) -> NewInstance:
    return NewInstance(
        job_key=key,
        source=InstanceSource.CRON,
        scheduled_at=at,
        skip_reason=skip_reason,
        actor="scheduler",
    )


def occurrence(key: str, at: datetime) -> NewInstance:
    return _occurrence(key, at, None)
