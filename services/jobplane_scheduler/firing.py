"""The leader's cron loop: wait for the next tick, fire what is due, publish it.

A tick's lag (its instances recorded Enqueued after the scheduled time) is what happens between
the wake-up and the insert, so that path is kept short: the records of the next tick are built
while the loop waits for it (:meth:`CronFiring._prepare`); a sleep that ran its full course to
the tick counts as having reached it, as late as the sleep says it woke (no clock read: that is
the time the misfire grace is measured on); and the store writes the whole tick in one
statement (:meth:`~jobplane.store.abc.LeaderStore.fire`), fenced by the lease's term and by
the definition version each job's tick was planned under. That last fence is what keeps a tick
from firing on options edited, or a pause committed, before it, whether or not the edit's
event has reached this leader yet: the fire itself refuses, and the jobs it names are read
again and re-planned. No check of pending updates waits in front of the insert. Where the
store can hold a write open (Postgres), the tick is even written before its time and only
committed at it (:mod:`jobplane_scheduler.ahead`); the fire at its time above remains the
way of every tick that could not be, and of SQLite's.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from jobplane import telemetry
from jobplane.clock import Clock
from jobplane.definitions import DefinitionCache
from jobplane.dispatch import Dispatcher
from jobplane.domain.models import Instance, JobDefinition, LeaderLease, NewInstance
from jobplane.errors import (
    DefinitionsChangedError,
    JobNotFoundError,
    StoreRefusedError,
    first_line,
)
from jobplane.store.abc import LeaderStore
from jobplane_scheduler.ahead import AheadFiring, finish, logger
from jobplane_scheduler.cron_timers import (
    CronTimers,
    Span,
    catch_up,
    earlier_spans,
    is_active,
    occurrence,
)
from jobplane_scheduler.metrics import SchedulerMetrics
from jobplane_scheduler.settings import SchedulerSettings

#: The records of a tick are built at most this long before it (while the loop waits).
PREPARE_AHEAD_S = 1.0
#: A re-plan pass takes jobs until their records reach this many (at least one job); the
#: rest wait for the cron loop's next pass (see _replan), so that a pass stays well within
#: the lease's renewal period.
REPLAN_BUDGET = 5_000
#: A re-plan's records are written this many at a time (a tick of 1,000 jobs is one write).
FIRE_CHUNK = 1_000


class CronFiring(AheadFiring):
    """The cron half of :class:`~jobplane_scheduler.duties.LeaderDuties`."""

    store: LeaderStore
    settings: SchedulerSettings
    lease: LeaderLease
    clock: Clock
    metrics: SchedulerMetrics
    dispatcher: Dispatcher
    timers: CronTimers
    cache: DefinitionCache
    _planning: asyncio.Lock
    _wake: asyncio.Event
    _backfill: dict[str, datetime]
    _unplanned: set[str]
    #: The records of the next tick, built ahead of it: (job key, tick) → record.
    _prepared: dict[tuple[str, datetime], NewInstance]
    _prepared_at: datetime | None

    async def _replan(self, keys: set[str]) -> None:
        """Re-plan the timers of the jobs whose definition changed and catch up their missed
        ticks (a resumed or edited job follows its misfire policy). Holds ``_planning``.

        The cache took the new definitions before: should this fail (an outage), the keys stay
        in ``_unplanned`` for the next version check, which found the cache up to date: a job
        resumed or edited during a short outage stayed unplanned until the next term."""
        if not keys:
            return
        # A tick written ahead for one of these jobs was planned under what changes here: it
        # is made at its time instead (the others' ticks stand: their timers do not move).
        await self._abandon_held(keys)
        self._unplanned |= keys
        cached = self.cache.definitions
        active = []
        for key in keys:
            definition = cached.get(key)
            if definition is None or self.settings.debug_no_auto_cron or not is_active(definition):
                self.timers.drop_job(key)
                self._backfill.pop(key, None)
            else:
                active.append(definition)
        last = await self.store.last_occurrences([d.key for d in active])
        earlier = await self._earlier(active, last)
        now = await self.clock.now()  # (after the reads: a tick due meanwhile is on time)
        records: list[NewInstance] = []
        planned: list[JobDefinition] = []
        for definition in self._in_turn(active):
            if records and len(records) >= REPLAN_BUDGET:
                # The pass is full (a new leader after an outage re-plans every job at once:
                # 1,000 one-second jobs 5 minutes behind were 300,000 records, 6 s without a
                # turn for the lease's renewal, whose term then ended before the fire, and the
                # next term began with the same pass): the rest go on as a backfill, in the
                # cron loop's next passes, from this pass's time. No timer of theirs fires
                # before (its ticks would move their last occurrence past the catch-up).
                self.timers.drop_job(definition.key)
                self._backfill.setdefault(definition.key, now)
                continue
            planned.append(definition)
            try:
                records.extend(
                    self._plan(
                        definition, last.get(definition.key), now, earlier.get(definition.key, ())
                    )
                )
            except Exception:  # (its schedule cannot be computed: the others still fire)
                self._schedule_failed(definition.key)
            # A turn for the lease's renewal (and the bus) between jobs. The cache does not
            # move meanwhile: it changes only under ``_planning``, which this holds.
            await asyncio.sleep(0)
        for definition in planned:
            # (Re-queued behind the jobs deferred above: a long backfill takes its turn with
            # them rather than before them, pass after pass.)
            if (looked := self._backfill.pop(definition.key, None)) is not None:
                self._backfill[definition.key] = looked
        try:
            changed = await self._fire_in_chunks(records)
        except BaseException:
            # Not written (or only a part of each job's oldest ticks): no timer fires before
            # the re-plan does (a tick recorded first would move the job's last occurrence past
            # the catch-up, which would never be written).
            for definition in planned:
                self.timers.drop_job(definition.key)
            raise
        self._unplanned -= keys
        if changed:
            await self._replan(changed)  # (re-planned under what the fire found stored)
        self._wake.set()

    def _in_turn(self, active: list[JobDefinition]) -> list[JobDefinition]:
        """The order a re-plan takes its jobs in: those not in a backfill first (an edit, a
        resume: planned at once), then the backfill's in its order (longest waiting first)."""
        turn = {key: i for i, key in enumerate(self._backfill)}
        return sorted(active, key=lambda d: turn.get(d.key, -1))

    async def _fire_in_chunks(self, records: list[NewInstance]) -> set[str]:
        """Fire a re-plan's records ``FIRE_CHUNK`` at a time, with a turn for the lease's
        renewal between chunks. Each job's records are in the order of their ticks, so a
        failure between chunks leaves written the oldest ticks of a job: its catch-up goes on
        from them, gap-free, as after a backfill pass. Returns the jobs read again (see
        :meth:`_fire_as_planned`); their later records, planned under what they no longer
        are, are not written."""
        changed: set[str] = set()
        for i in range(0, len(records), FIRE_CHUNK):
            chunk = records[i : i + FIRE_CHUNK]
            if changed:
                chunk = [r for r in chunk if r.job_key not in changed]
            changed |= await self._fire_as_planned(chunk)
            if i + FIRE_CHUNK < len(records):
                await asyncio.sleep(0)
        return changed

    def _plan(
        self,
        definition: JobDefinition,
        last: datetime | None,
        now: datetime,
        earlier: Sequence[Span] = (),
    ) -> list[NewInstance]:
        """Catch up a job's missed ticks (``earlier``: those due under the schedules its last
        edit replaced, see _earlier) and plan its timer; returns the records to write."""
        # Every pass of a backfill looks from its first pass's time: a tick within the grace
        # then is not missed for the time the passes took (those due since are planned next).
        looked = self._backfill.get(definition.key, now)
        since = definition.schedule_since
        if since is not None and since > looked:
            # Its schedule was edited after the backfill began: the old schedule's ticks up to
            # the edit are caught up too (from ``earlier``), not only those up to the first
            # pass (the rest, due before the edit, were in no span once the timer planned
            # from it: lost without a record). The backfill starts again from now.
            looked = now
        caught = catch_up(definition, last, looked, earlier)
        made = caught.records
        if not caught.complete:
            # A long outage: this pass records a batch of its oldest missed ticks; the cron
            # loop runs the next pass (after any due tick of other jobs), and only the last
            # one plans the job's timer.
            self.timers.drop_job(definition.key)
            self._backfill[definition.key] = looked
            return made
        self._backfill.pop(definition.key, None)
        # The timer goes on from the latest tick written, and never from before the last
        # edit of the schedule: its ticks before that never existed.
        marks = [t for t in (last, since, *(m.scheduled_at for m in made)) if t is not None]
        self.timers.set_job(definition, max(marks, default=None), now)
        return made

    async def _earlier(
        self, active: list[JobDefinition], last: dict[str, datetime]
    ) -> dict[str, list[Span]]:
        """The spans of the schedules that each job's last schedule edit replaced, from its
        last occurrence to the edit, for the jobs whose edit came after it: their ticks due in
        between were missed too (an outage of the leader, or a pause, across the edit). One
        read for all of them (a new leader re-plans every job at once)."""
        starts = {}
        for definition in active:
            since = definition.schedule_since
            start = last.get(definition.key) or definition.created_at
            if since is not None and start is not None and since > start:
                starts[definition.key] = (start, since)
        if not starts:
            return {}
        histories = await self.store.schedule_histories({k: s for k, (s, _) in starts.items()})
        return {key: earlier_spans(histories[key], since) for key, (_, since) in starts.items()}

    def _schedule_failed(self, key: str) -> None:
        """Log a job whose schedule cannot be computed and leave it unplanned until its
        definition changes (the API shows the same error on the job)."""
        self.timers.drop_job(key)
        self._backfill.pop(key, None)
        logger.exception(
            "job %s: its next fire time cannot be computed; it does not fire until edited",
            key,
            extra={"action": "scheduler.schedule_error", "job_key": key},
        )

    async def _cron_loop(self) -> None:
        reached: datetime | None = None
        try:
            while True:
                # A sleep that ran its full course to the next tick has reached it on the clock
                # (see Clock.sleep), plus the lateness it reported: no need to read the clock.
                now = reached or await self.clock.now()
                self._now_taken = time.monotonic()
                async with self._planning:
                    # A tick written ahead is committed first (see jobplane_scheduler.ahead).
                    committed, now = await self._commit_ahead(now)
                    due = self.timers.pop_due(now)
                    if due:
                        await self._fire_due(due, now, committed)
                        reached = None
                        continue
                    if self._backfill:
                        await self._replan(set(self._backfill))
                        reached = None
                        continue
                    if reached is not None:
                        # Woken at a tick that a re-plan took away while this loop waited for
                        # ``_planning``: read the clock before sleeping on (the next sleep
                        # counts from a reading of it, not from the tick's time).
                        reached = None
                        continue
                    at = self.timers.next_time()
                    if at is not None and self._ahead_time(at, now) <= 0:
                        await self._write_ahead(at)
                        reached = None
                        continue
                reached = await self._sleep_until(self.timers.next_time(), now)
        finally:
            await self._abandon_held()

    def _prepare(self, at: datetime) -> None:
        """Build the records of the tick at ``at`` now, while there is time, rather than after
        waking for it. Only a record for the very (job, tick) popped is used: a re-plan in
        between (an edit, a catch-up) leaves the others unused."""
        self._prepared = {due: occurrence(*due) for due in self.timers.due_at(at)}
        self._prepared_at = at

    async def _fire_due(
        self,
        due: list[tuple[str, datetime]],
        now: datetime,
        committed: frozenset[tuple[str, datetime]] = frozenset(),
    ) -> None:
        """Fire the due ticks (``now``: the clock's time, read or reached), each only while its
        job's stored definition is the version it was planned under (those of ``committed``
        were written ahead and are committed: only their timers move on). Holds
        ``_planning``."""
        popped = due[-1][1] if due else None
        fired = [t for t in due if t in committed]
        due = [t for t in due if t not in committed] if committed else due
        # A tick later than its job's misfire grace (the leader fell behind: a pause shorter
        # than the lease, overload) follows the misfire policy, as after a failover: the job
        # is re-planned through the catch-up from its last recorded occurrence.
        definitions = self.cache.definitions  # (a copy: taken once, not once per tick)
        late = {key for key, at in due if _late(definitions.get(key), at, now)}
        if late:
            await self._replan(late)
            due = [(key, at) for key, at in due if key not in late]
        prepared = self._prepared
        records = [prepared.pop(t) if t in prepared else occurrence(*t) for t in due]
        if self._prepared_at is not None and popped is not None and self._prepared_at <= popped:
            self._prepared.clear()  # their tick has come: what is left will not be used
        if self._held is not None and self._held.at <= now:
            await self._abandon_held()  # (not committed at its tick: fired as any tick is)
        changed = await self._fire_as_planned(records)
        if changed:
            await self._replan(changed)
            due = [(key, at) for key, at in due if key not in changed]
        for key, at in fired + due:
            try:
                self.timers.advance(key, at)
            except Exception:
                self._schedule_failed(key)

    async def _sleep_until(self, at: datetime | None, now: datetime) -> datetime | None:
        """Sleep on the clock until ``at`` (or a wake-up): the loop then fires only what is
        due. Returns the time reached when the sleep ran its full course to ``at`` (``at``
        plus how late the sleep says it woke: the time the misfire grace is measured on),
        else None (woken early, or stopped short of it: the loop reads the clock), so waking
        early never fires early.

        The tick's records are built first, at most ``PREPARE_AHEAD_S`` before it (an
        instance's id carries the time it was made): a farther tick is slept towards until
        then, and once built the loop reads the clock again, so the sleep to the tick does
        not count the building as waiting."""
        if at is None:
            delay = self.settings.sweep_interval_s
        else:
            delay = (at - now).total_seconds()
            if delay <= PREPARE_AHEAD_S and self._prepared_at != at:
                self._prepare(at)
                return None
        self._wake.clear()
        if at is not None and self._prepared_at != at:
            await self.clock.sleep(min(delay - PREPARE_AHEAD_S, 60.0), self._wake)
            return None
        if at is not None and (ahead := self._ahead_time(at, now)) < math.inf:
            await self.clock.sleep(min(ahead, 60.0), self._wake)
            return None  # (the loop writes it ahead, then sleeps on to the tick)
        # (A tick held is woken for a little before it: its commit waits for it in the
        # database; see COMMIT_EARLY_S. The loop commits once that close, so the sleep left is
        # never shorter.)
        early = self._commit_early(at)
        late = await self.clock.sleep(min(delay - early, 60.0), self._wake)
        if at is None or delay > 60.0 or self._wake.is_set():
            return None
        return at + timedelta(seconds=late - early)

    async def _fire_as_planned(self, records: list[NewInstance]) -> set[str]:
        """Fire ``records``, each job's only while it is stored at the version cached here
        (the one its ticks were planned under). A job edited, paused or resumed since, its
        event not applied yet (in flight, or lost), is refused by the fire with nothing
        written: it is read again, and the others fire. Returns the jobs read again, for the
        caller to re-plan from their last occurrence under what is stored (a tick still valid
        under it then fires through the catch-up). A job whose definition is gone is read
        again too (and so dropped). Each refusal drops a job, so this ends."""
        changed: set[str] = set()
        while records:
            definitions = self.cache.definitions
            planned = {
                r.job_key: definitions[r.job_key].version
                for r in records
                if r.job_key in definitions
            }
            try:
                await self._fire(records, planned)
                break
            except DefinitionsChangedError as refused:
                keys: set[str] = set(refused.keys)
            except JobNotFoundError as gone:
                # Its definition row was deleted behind the product's back (no command
                # deletes one): read again, it leaves the cache and its timers are dropped,
                # rather than this fire's error ending the leader's duties.
                keys = {gone.key}
            await self.cache.reload(keys)
            changed |= keys
            records = [r for r in records if r.job_key not in keys]
        return changed

    async def _fire(self, records: list[Any], planned: dict[str, int]) -> None:
        """Fire ``records`` and publish them, only while every job is stored at the version
        ``planned`` gives it (job key → the definition version its ticks were planned under)."""
        await finish(self._fire_and_publish(records, planned))

    async def _fire_and_publish(self, records: list[Any], planned: dict[str, int]) -> None:
        with telemetry.span("jobplane.trigger", source="cron", instances=len(records)):
            # The publication is recorded by the fire itself (one write less before the
            # messages go out), unless the bus is out of reach (see Dispatcher.publish).
            marks = self.dispatcher.marks_first
            try:
                instances = await self.store.fire(
                    self.lease, records, published=marks, planned=planned
                )
            except StoreRefusedError as exc:
                # (Job by job, without the version fence: the fallback for a poison job; an
                # edit still in flight then waits for the next sweep's version check.)
                instances = await self._fire_each_job(records, exc, marks)
            await self._publish_fired(instances, records)

    async def _fire_each_job(
        self, records: list[Any], exc: StoreRefusedError, marks: bool
    ) -> list[Instance]:
        """The database refused a batch of ticks (a poison job: data or a constraint it
        rejects; outages and conflicts are other errors). Fire each job's ticks on
        their own: a job still refused is logged with its key and its ticks skipped (as are those
        of a job deleted meanwhile), and every other job fires."""
        by_job: dict[str, list[Any]] = {}
        for record in records:
            by_job.setdefault(record.job_key, []).append(record)
        fired: list[Instance] = []
        for key, ticks in by_job.items():
            try:
                if len(by_job) == 1:
                    raise exc  # that job alone was refused
                fired += await self.store.fire(self.lease, ticks, published=marks)
            except StoreRefusedError as refused:
                logger.error(
                    "the database refused %d tick(s) of job %s: %s; skipped",
                    len(ticks),
                    key,
                    first_line(refused),
                    extra={"action": "scheduler.fire_refused", "job_key": key},
                )
            except JobNotFoundError:
                # Its definition row was deleted in SQL since the batch was planned: its ticks
                # go, and the next fire that names it drops its timers (_fire_as_planned).
                logger.warning(
                    "job %s no longer exists; %d tick(s) skipped",
                    key,
                    len(ticks),
                    extra={"action": "scheduler.job_gone", "job_key": key},
                )
        return fired


def _late(definition: JobDefinition | None, at: datetime, now: datetime) -> bool:
    """Whether the tick at ``at`` is past its job's misfire grace at ``now``."""
    if definition is None:
        return False
    return (now - at).total_seconds() > definition.options.misfire_grace_s
