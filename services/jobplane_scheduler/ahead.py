"""A cron tick written ahead of its time and committed at it (where the store can hold a write
open: Postgres).

Fired at its time, a tick of 1,000 jobs was visible tens of milliseconds after it: the insert
of its rows and their history is what took the time. So the leader writes the tick a moment
before it (``FIRE_AHEAD_S``), in a transaction it leaves open, encodes its messages, and at
the tick commits and appends them: what is left after the tick is a commit and one script
call. Nobody sees the instances before the commit, and what the open transaction locks keeps
the write true until then (``jobplane/store/ahead.py``): an edit of one of its jobs waits for
it, and so comes after the tick; a takeover (of a lease expired: this leader froze) ends it.

Just before the tick (``COMMIT_EARLY_S``) the commit is sent, and the database waits for the
tick itself to commit it: the leader's wake-up need not be on time. The commit comes first,
before the timers' own bookkeeping, when the leader woke no later than ``COMMIT_WITHIN_S``
after the tick (nor than any of its jobs' misfire grace): the records say the tick, true to
within that. Otherwise (woken late, or the timers changed since: an
edit, a catch-up) the write is rolled back and the tick is fired as any tick is, recording
when it was, late ticks by their misfire policy. The database checks the same at the commit,
on its own clock. A commit that fails leaves the fire to that same path, which finds what
the commit may have recorded.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

from jobplane import telemetry
from jobplane.definitions import DefinitionCache
from jobplane.dispatch import Dispatcher
from jobplane.domain.models import Instance, LeaderLease, NewInstance
from jobplane.errors import first_line
from jobplane.publishing import CreatedPublication
from jobplane.store.abc import HeldFire, LeaderStore
from jobplane_scheduler.cron_timers import CronTimers
from jobplane_scheduler.metrics import SchedulerMetrics

#: How long before its tick a tick is written: long enough for a 1,000-row tick's insert on a
#: busy machine, short, as its jobs' definitions stay locked (their edits wait) meanwhile.
#: (At most a quarter of the session's idle-transaction limit: see LeaderDuties.)
FIRE_AHEAD_S = 0.25

#: A tick written ahead is committed only if the leader reaches it within this long: its
#: records say the tick, so they are true to within it. Later (a stalled leader), it is
#: rolled back and fired as any tick is, recording when it was.
COMMIT_WITHIN_S = 0.05

#: A tick written ahead is committed this long before the leader's clock reaches it: the
#: database waits for the tick itself before it commits (``commit_at``), so a wake-up late by
#: up to this much (the event loop's timer, a busy machine: 5 to 18 ms, one tick in ten,
#: measured here) no longer delays the commit. The leader's own wait for the commit holds its
#: planning (an edit's re-plan) that much longer.
COMMIT_EARLY_S = 0.025

T = TypeVar("T")

# The role's one logger name, as before the split (operators filter on it).
logger = logging.getLogger("jobplane_scheduler.scheduler")


@dataclass(frozen=True)
class Ahead:
    """A tick written ahead: its time, its (job key, tick) pairs, the records written, the
    least misfire grace of its jobs (seconds), the open write, and its messages, encoded."""

    at: datetime
    ticks: frozenset[tuple[str, datetime]]
    records: list[NewInstance]
    grace_s: float
    held: HeldFire
    publication: CreatedPublication


async def finish(firing: Coroutine[Any, Any, T]) -> T:
    """Run ``firing`` to its end even if the duties are cancelled meanwhile."""
    # A stop (SIGTERM, lost term) cancels the duties, possibly between the insert and the
    # publish. Finish the fire first, so a stored tick is published now rather than when the
    # next leader's sweep finds it unpublished.
    task = asyncio.ensure_future(firing)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.gather(task, return_exceptions=True)
        raise


class AheadFiring:
    """The leader's ticks written ahead, and the publication of every fired tick."""

    store: LeaderStore
    lease: LeaderLease
    metrics: SchedulerMetrics
    dispatcher: Dispatcher
    timers: CronTimers
    cache: DefinitionCache
    _prepared: dict[tuple[str, datetime], NewInstance]
    _prepared_at: datetime | None
    #: The tick written ahead and not committed yet; the last tick a write ahead was tried for.
    _held: Ahead | None
    _ahead_tried: datetime | None
    #: How long before a tick it is written, and whether the store can (its first None: no).
    _fire_ahead_s: float
    _ahead_supported: bool
    #: The monotonic time at which the cron loop took its ``now`` (read, or reached by a sleep).
    _now_taken: float
    #: Whether the garbage collector is paused while a tick is held (see _write_ahead).
    _gc_paused: bool

    def _ahead_time(self, at: datetime, now: datetime) -> float:
        """Seconds from ``now`` until the tick at ``at`` is to be written ahead: infinite if
        it is not (its records not built yet, tried already, or the store cannot hold a
        write open)."""
        if self._prepared_at != at or self._ahead_tried == at or not self._ahead_supported:
            return math.inf
        return (at - now).total_seconds() - self._fire_ahead_s

    async def _write_ahead(self, at: datetime) -> None:
        """Write the tick at ``at`` now, in a transaction committed at the tick. Holds
        ``_planning``. Anything in the way (an edit the write found, a job gone, an outage)
        is left to the fire at the tick, which meets it as it always does."""
        self._ahead_tried = at
        await self._abandon_held()
        due = self.timers.due_at(at)
        definitions = self.cache.definitions
        if not due or any(t not in self._prepared or t[0] not in definitions for t in due):
            return
        records = [self._prepared[t] for t in due]
        planned = {key: definitions[key].version for key, _ in due}
        grace_s = min(definitions[key].options.misfire_grace_s for key, _ in due)
        try:
            # (Not shielded from a stop, unlike a fire: the write is rolled back if cancelled.)
            held = await self.store.fire_ahead(
                self.lease, records, published=self.dispatcher.marks_first, planned=planned
            )
        except Exception as exc:  # (not CancelledError)
            logger.debug("tick %s not written ahead: %s", at, first_line(exc))
            return
        if held is None:
            self._ahead_supported = False
            return
        try:
            # Its messages are made ready too: at the tick, the commit and their append are
            # left.
            ids = {r.id for r in records}
            publication = self.dispatcher.prepare_created(held.instances, ids)
        except BaseException:
            await held.abandon()
            raise
        self._held = Ahead(at, frozenset(due), records, grace_s, held, publication)
        # A full collection of the leader's heap took 12 to 27 ms here, at any moment: one
        # landing between the tick and its commit would be the tick's lag. The collector waits
        # from here until the tick is committed and sent (a quarter of a second), then runs.
        if gc.isenabled():
            gc.disable()
            self._gc_paused = True

    def _commit_early(self, at: datetime | None) -> float:
        """How long before the tick at ``at`` the loop wakes to commit it: ``COMMIT_EARLY_S``
        if that tick is held, else 0 (a tick fired at its time is woken for at its time).
        (Cron ticks fall on whole seconds, so no other tick comes between the wake-up and the
        held one, to be fired only after its commit.)"""
        ahead = self._held
        return COMMIT_EARLY_S if ahead is not None and ahead.at == at else 0.0

    async def _commit_ahead(
        self, now: datetime
    ) -> tuple[frozenset[tuple[str, datetime]], datetime]:
        """At ``now``, commit and publish the tick written ahead if it is about to come
        (within ``COMMIT_EARLY_S``) or has come within ``COMMIT_WITHIN_S`` and every one of its
        jobs' misfire grace. Returns its (job key, tick) pairs if committed (the caller fires
        the rest of what is due) and the time from then on: at least the tick once committed
        (the database committed it once its clock read the tick). Holds ``_planning``."""
        ahead = self._held
        if ahead is None or now < ahead.at - timedelta(seconds=COMMIT_EARLY_S):
            return frozenset(), now
        # (``now`` was taken before this task got ``_planning``: count the wait for it too)
        late_s = (now - ahead.at).total_seconds() + time.monotonic() - self._now_taken
        if late_s > min(ahead.grace_s, COMMIT_WITHIN_S):
            await self._abandon_held()  # (its locks go now; the tick is fired as any tick is)
            return frozenset(), now
        self._held = None
        try:
            committed = await finish(self._commit_and_publish(ahead, now))
        finally:
            self._settled()
        if not committed:
            return frozenset(), now
        if now < ahead.at:
            now, self._now_taken = ahead.at, time.monotonic()
        return ahead.ticks, now

    async def _commit_and_publish(self, ahead: Ahead, now: datetime) -> bool:
        """Commit the tick written ahead and publish it; False if the commit failed (the
        caller fires the records at once: what the commit may have recorded is found)."""
        records = ahead.records
        with telemetry.span("jobplane.trigger", source="cron", instances=len(records)):
            try:
                instances = await ahead.held.commit(min(ahead.grace_s, COMMIT_WITHIN_S))
            except Exception as exc:  # (not CancelledError)
                logger.warning(
                    "a tick written ahead was not committed (%s); firing it now",
                    first_line(exc),
                    extra={"action": "scheduler.ahead_failed"},
                )
                return False
            # Its lag: from the tick to the commit's return (its instances' recorded times
            # say the tick, as nobody saw them before the commit).
            lag_s = (now - ahead.at).total_seconds() + time.monotonic() - self._now_taken
            await self._publish_fired(instances, records, ahead.publication, lag_s)
        return True

    async def _abandon_held(self, keys: set[str] | None = None) -> None:
        """Roll back the tick written ahead, if any (its fire is then made at the tick); with
        ``keys``, only if it has a tick of one of those jobs."""
        ahead = self._held
        if ahead is None or (keys is not None and not any(k in keys for k, _ in ahead.ticks)):
            return
        self._held = None
        try:
            await ahead.held.abandon()
        finally:
            self._settled()

    def _settled(self) -> None:
        """Once a held tick is committed or given up: let the collector run again if the tick
        paused it (see _write_ahead)."""
        if self._gc_paused:
            self._gc_paused = False
            gc.enable()

    async def _publish_fired(
        self,
        instances: list[Instance],
        records: Sequence[NewInstance],
        prepared: CreatedPublication | None = None,
        lag_s: float | None = None,
    ) -> None:
        """Send the fired ``instances`` (``records``: what the fire was given; ``prepared``:
        their messages, made ready before the tick; ``lag_s``: the fire's lag, if its
        instances' creation times do not tell it)."""
        try:
            # Sent before the ticks are counted: the messages wait for nothing else.
            if prepared is None:
                await self.dispatcher.publish_created(instances, {r.id for r in records})
            else:
                await self.dispatcher.publish_prepared(prepared)
        finally:
            self.metrics.fired(instances, self.cache.definitions, lag_s)
        fired = [i for i in instances if not i.state.is_terminal]
        if fired:
            logger.debug("fired %d tick(s)", len(fired), extra={"action": "scheduler.fired"})
