"""The leader's duties, run while a :class:`~jobplane_scheduler.scheduler.Scheduler` holds the
lease: fire cron ticks, promote due instances, release expired leases, republish what the bus
lost, publish what applications enqueued. Each write is fenced by the lease's term."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import time
from collections import defaultdict
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from uuid import UUID

from jobplane.bus.abc import Bus, BusEpoch
from jobplane.bus.envelope import Event, EventKind
from jobplane.clock import Clock, StoreClock
from jobplane.definitions import DefinitionCache
from jobplane.dispatch import Dispatcher
from jobplane.domain.models import Instance, LeaderLease
from jobplane.errors import (
    BusUnavailableError,
    NotLeaderError,
    StoreRefusedError,
    UnavailableError,
    first_line,
)
from jobplane.events import Outage, listen
from jobplane.ids import valid_ids
from jobplane.store.abc import LeaderStore, PublishedKey
from jobplane.store.creation import DUE_PREFIX, ENQUEUED_CHANNEL
from jobplane.tasks import run_together
from jobplane.triggering import envelope_for
from jobplane_scheduler import housekeeping
from jobplane_scheduler.ahead import FIRE_AHEAD_S
from jobplane_scheduler.cron_timers import CronTimers
from jobplane_scheduler.firing import CronFiring
from jobplane_scheduler.metrics import SchedulerMetrics, SweepStep
from jobplane_scheduler.settings import SchedulerSettings

# The role's one logger name, as before the split (operators filter on it).
logger = logging.getLogger("jobplane_scheduler.scheduler")

#: While the database is away, the enqueued-notifications listener listens again this often.
ENQUEUED_RELISTEN_S = 1.0
#: A lease that ends between sweeps is released at most this long after its end: the leader
#: wakes once for all the leases that end within this of the first (so that many workers
#: renewing at different moments, with a lease close to the heartbeat, do not wake it for
#: each), and after the end (the release takes leases that ended strictly before the
#: database's time).
LEASE_WAKE_WINDOW = timedelta(milliseconds=50)
#: Instances promoted, or attempts released, per statement (again while a batch is full).
SWEEP_BATCH = 1000
#: Instances the republish sweep looks for at each sweep, at most.
UNPUBLISHED_PAGE = 1000


class LeaderDuties(CronFiring):
    """What the leader does while its term lasts. Cancelled when the term ends."""

    def __init__(
        self,
        store: LeaderStore,
        bus: Bus,
        settings: SchedulerSettings,
        lease: LeaderLease,
        metrics: SchedulerMetrics | None = None,
        *,
        clock: Clock | None = None,
    ) -> None:
        self.store = store
        self.bus = bus
        self.settings = settings
        self.lease = lease
        #: Cron ticks are planned against it and waited for on it (see :class:`Scheduler`).
        self.clock: Clock = clock or StoreClock(store)
        self.metrics = metrics or SchedulerMetrics(lambda: lease)
        self.dispatcher = Dispatcher(store, bus, fence=lease)
        self.timers = CronTimers()
        self.cache = DefinitionCache(store, bus)
        # Serialises re-planning and firing: the cron loop, the sweep and the event listener
        # all apply definition changes, and a tick must be planned once.
        self._planning = asyncio.Lock()
        self._wake = asyncio.Event()
        self._epoch: BusEpoch | None = None
        self._delayed: list[datetime] = []
        #: run_at of instances made Scheduled since the sweep read _delayed (announced by the
        #: database on commit), and the event that wakes the sleep for them.
        self._announced: list[datetime] = []
        self._announcing = asyncio.Event()
        #: Ends of running attempts' leases before the next sweep (see _sleep_until_sweep).
        self._lease_ends: list[datetime] = []
        #: Jobs whose missed ticks are still recorded in batches (see catch_up) → the time
        #: their first pass looked from; and jobs cached but not yet re-planned (_replan).
        self._backfill: dict[str, datetime] = {}
        self._unplanned: set[str] = set()
        self._prepared = {}
        self._prepared_at = None
        # A tick written ahead is committed once the database's clock reaches it: only a
        # leader on that clock writes ahead (a test's driven clock runs ahead of it).
        self._held, self._ahead_tried = None, None
        self._ahead_supported = isinstance(self.clock, StoreClock)
        self._now_taken, self._gc_paused = time.monotonic(), False
        # A held write must commit well within the server's limit on an idle transaction.
        idle = settings.session_limits().idle_in_transaction_timeout_s
        self._fire_ahead_s = min(FIRE_AHEAD_S, idle / 4)
        #: Expired leases are released from this (monotonic) time on (see ``reap_grace_s``).
        self._reap_from = 0.0
        #: Where the republish sweep's next page of published instances starts, and when
        #: (monotonic) its walk last started from the oldest (see _stale).
        self._stale_after: PublishedKey | None = None
        self._walk_began = time.monotonic()

    async def run(self) -> None:
        deposed = False
        while not deposed:
            # (Re)start from scratch: every job re-planned from its last recorded occurrence,
            # so ticks due during an outage are caught up per the misfire policy.
            self.timers = CronTimers()
            self.cache = DefinitionCache(self.store, self.bus)
            self._backfill.clear()
            self._unplanned.clear()
            self._prepared, self._prepared_at = {}, None
            self._ahead_tried = None
            # After an outage every lease may look expired: give the workers a heartbeat (and
            # their outcomes a retry) before reaping, so finished or running work is not re-run.
            self._reap_from = time.monotonic() + self.settings.reap_grace_s
            try:
                await self._load_definitions()
                await run_together(
                    self._cron_loop(), self._sweep_loop(), self._event_loop(), self._enqueued_loop()
                )
            except* NotLeaderError:
                logger.warning(
                    "term %d is over; stopping leader duties",
                    self.lease.term,
                    extra={"action": "scheduler.deposed"},
                )
                deposed = True
            except* UnavailableError as group:
                # An outage pauses the duties, it does not end the term. Nothing is lost: the
                # restart re-plans every job from what is recorded, and every write is fenced,
                # so if the lease ran out meanwhile the next write ends the duties instead.
                logger.warning(
                    "leader duties paused: %s",
                    group.exceptions[0],
                    extra={"action": "scheduler.paused"},
                )
                await asyncio.sleep(self.settings.sweep_interval_s)

    # -- cron ------------------------------------------------------------------------------

    async def _load_definitions(self) -> None:
        """Apply definition changes found by the version check against Postgres (the sweep's
        backstop for lost events and marks; at start: every definition)."""
        async with self._planning:
            await self._replan(await self.cache.refresh(verify=True) | self._unplanned)

    @contextlib.contextmanager
    def _refused(self, step: str) -> Iterator[None]:
        """One sweep step the database refuses (a poison row in its batch) is logged; the
        other steps, the next sweeps and the cron loop go on."""
        try:
            yield
        except StoreRefusedError as exc:
            logger.error(
                "sweep step %s refused by the database: %s",
                step,
                first_line(exc),
                extra={"action": "scheduler.sweep_refused", "step": step},
            )

    # -- sweeps ----------------------------------------------------------------------------

    async def _sweep_loop(self) -> None:
        last_housekeeping = datetime.min
        while True:
            with self.metrics.sweep_duration.time():
                await self._sweep_once()
            if datetime.now() - last_housekeeping > timedelta(minutes=1):
                last_housekeeping = datetime.now()
                with self._refused("housekeeping"):  # (optional work: never the leader's end)
                    await self._housekeeping()
            await self._sleep_until_sweep()

    async def _sweep_once(self) -> None:
        """Find what no event announced: definitions edited, due instances, expired leases,
        lost messages, a bus that restarted empty, dead workers."""
        with self._refused("definitions"):
            await self._load_definitions()
        with self._refused("promote"):
            await self._promote()
        await self._release_expired()
        with self._refused("bus epoch"):
            # Its marker is written only after the republish: a refused one is tried again.
            await self._check_bus_epoch()
        with self._refused("republish"):
            await self._republish(await self._lost(await self._stale()))
        with self._refused("unknown jobs"):
            terminated = await self.store.terminate_unknown_jobs(
                self.lease, self.settings.unknown_job_timeout_s
            )
            self.metrics.count(SweepStep.UNKNOWN_JOBS, terminated)
        with self._refused("dead workers"):
            dead = await self.store.mark_dead_workers(
                self.settings.dead_worker_after_s, fence=self.lease
            )
            self.metrics.count(SweepStep.DEAD_WORKERS, dead)
        with self._refused("orphaned pins"):
            unpinned = await self.store.resolve_orphaned_pins(
                self.lease, self.settings.unknown_job_timeout_s
            )
            self.metrics.count(SweepStep.ORPHANED_PINS, [i for i, _ in unpinned])
            await self._publish([i for i, _ in unpinned])
            await self._drop_old_pins(unpinned)
        self._delayed = await self.store.scheduled_due_within(self.settings.sweep_interval_s)
        self._lease_ends = await self.store.leases_ending_within(self.settings.sweep_interval_s)

    async def _release_expired(self) -> None:
        """Release the attempts whose lease has ended (none during the start-up grace)."""
        if time.monotonic() < self._reap_from:
            return
        with self._refused("expired leases"):
            full = True
            while full:  # (a full batch: more may have ended)
                released = await self.store.release_expired(self.lease, SWEEP_BATCH)
                self.metrics.count(SweepStep.EXPIRED_LEASES, released)
                await self._publish(released)
                full = len(released) >= SWEEP_BATCH

    async def _promote(self) -> None:
        """Promote due instances; a batch the database refuses goes one by one, so a poison
        instance is skipped (logged with its id) and the others are promoted. Batch after
        batch while they come back full: a wake for many instances due at once (a bulk trigger
        with a delay) promotes them all, not the first batch and the rest a sweep later."""
        full = True
        while full:
            try:
                promoted = await self.store.promote_due(self.lease, SWEEP_BATCH)
            except StoreRefusedError:
                promoted = await self.store.promote_due_each(self.lease, SWEEP_BATCH)
            self.metrics.count(SweepStep.PROMOTED, promoted)
            await self._publish(promoted)
            full = len(promoted) >= SWEEP_BATCH

    async def _stale(self) -> list[Instance]:
        """The next page of Enqueued instances whose message may be lost: those never
        published, then published ones by (publication time, id), on from where the last page
        ended. Once the walk has reached the newest stale instance it waits there, taking
        each one that becomes stale as it does, until ``republish_after_s`` has passed since
        it began; then it begins again from the oldest. So every waiting instance is looked
        for about once per ``republish_after_s`` (or per ``backlog / UNPUBLISHED_PAGE``
        sweeps, if longer), one newly stale at once, and nothing found is written. Marking
        those found published again, as this sweep did, rewrote 1,000 rows a second while a
        backlog waited, and spread the next ones asked for across the stream, each look
        reading it from the start up to the last of them."""
        stale = await self.store.unpublished(
            self.settings.republish_after_s, UNPUBLISHED_PAGE, after=self._stale_after
        )
        published = [(i.published_at, i.id) for i in stale if i.published_at is not None]
        if published:
            self._stale_after = max(published)
        at_newest = len(stale) < UNPUBLISHED_PAGE
        if at_newest and time.monotonic() - self._walk_began >= self.settings.republish_after_s:
            self._stale_after = None  # the next sweep begins again from the oldest
            self._walk_began = time.monotonic()
        return stale

    async def _lost(self, stale: list[Instance]) -> list[Instance]:
        """Those of ``stale`` (unclaimed long after publication) whose message is really gone.
        One still in its stream (unread, or delivered less than ``republish_after_s`` ago and
        not yet acknowledged) is not published again: a backlog must not grow the stream.
        An entry delivered longer ago and still unacknowledged counts as lost (its consumer
        may be gone): the copy goes out now rather than at the next reclaim."""
        if not stale:
            return []
        try:
            present = await self.bus.queued(
                [(i.queue, envelope_for(i)) for i in stale],
                stuck_after_ms=int(self.settings.republish_after_s * 1000),
            )
        except UnavailableError:
            return stale  # the publish fails too, and the next sweep looks again
        return [i for i in stale if i.id not in present]

    async def _check_bus_epoch(self) -> None:
        """Redis restarted (new run_id) or was flushed (its marker is gone; a flush keeps the
        run_id): its streams and pending-update marks may be gone. Republish every Enqueued
        instance at once and reload every definition (unless this leader has just loaded them
        all, at its first look), then write the marker. The marker is
        written only after the republish, so a leader that dies in between leaves it missing
        and the next leader republishes again (at its first sweep)."""
        try:
            epoch = await self.bus.epoch()
        except UnavailableError:
            return
        if epoch.marker is not None and epoch == self._epoch:
            return
        if epoch.marker is None or self._epoch is not None:
            # Seen changing under this leader: a restart or flush. Missing at this leader's
            # first look: a new bus (first start, or the in-process bus of `jobplane dev`) or
            # one flushed while no leader ran; the two look alike, and both are republished.
            level = logging.WARNING if self._epoch is not None else logging.INFO
            logger.log(
                level,
                "the bus restarted or was flushed (or is new); republishing every Enqueued "
                "instance",
                extra={"action": "scheduler.bus_restarted"},
            )
            await self._republish_all()
            if self._epoch is not None:
                # Its pending-update marks are gone too: reload every definition. (At the
                # first look they were all just loaded from Postgres as the duties started.)
                async with self._planning:
                    await self._replan(await self.cache.reload_all())
        try:
            self._epoch = await self.bus.mark_epoch()
        except UnavailableError:
            return

    async def _sleep_until_sweep(self) -> None:
        """Sleep until the next sweep, waking on the way at each delayed instance's run_at (to
        promote it) and within ``LEASE_WAKE_WINDOW`` after each lease's end (to release the
        attempt if its worker did not renew it), so that delayed instances start to the
        millisecond and a dead worker's attempts are taken over when their leases end, not up
        to a sweep interval later (docs/benchmarks.md, "Worker takeover"). The run_at times
        are the sweep's read, and those announced since (see _enqueued_loop): a delay shorter
        than the interval, or a retry's backoff, made after the read. The times are the
        store's: promotion and expiry are decided against its clock in SQL. The store's clock
        is read once, and the loop's clock counts from there: the read's way back makes every
        wake a little late, never early."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.settings.sweep_interval_s
        wakes = [(at, False) for at in self._delayed]
        wakes += [(at, True) for at in _lease_wakes(self._lease_ends)]
        heapq.heapify(wakes)
        offset: float | None = None  # the store's clock (epoch seconds) minus the loop's
        while True:
            for at in self._announced:
                heapq.heappush(wakes, (at, False))
            self._announced.clear()
            self._announcing.clear()
            if wakes and offset is None:
                offset = (await self.store.now()).timestamp() - loop.time()
            until = end
            if wakes and offset is not None:
                until = min(end, wakes[0][0].timestamp() - offset)
            if until > loop.time():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._announcing.wait(), until - loop.time())
                continue
            if loop.time() >= end:
                return
            # Everything due by now is one promotion (and one release), however many wakes.
            due, now = [], loop.time()
            while wakes and offset is not None and wakes[0][0].timestamp() - offset <= now:
                due.append(heapq.heappop(wakes)[1])
            if any(due):
                await self._release_expired()
            if not all(due):
                with self._refused("promote"):
                    await self._promote()

    async def _republish_all(self) -> None:
        after: UUID | None = None
        while True:
            page = await self.store.all_enqueued(after)
            if not page:
                return
            # After a restart or flush the streams are empty and everything goes out; a bus
            # merely new to this leader may still hold the messages, which are not doubled.
            await self._republish(await self._lost(page))
            after = page[-1].id

    async def _housekeeping(self) -> None:
        if self.settings.retention_days:
            await housekeeping.delete_finished(self.store, self.settings.retention_days, self.lease)
        kept = timedelta(seconds=self.settings.unknown_job_timeout_s)
        kept = max(housekeeping.STOPPED_WORKERS_KEPT, kept)
        gone = await housekeeping.forget_stopped_workers(self.store, self.bus, kept, self.lease)
        self.metrics.count(SweepStep.FORGOTTEN_WORKERS, gone)

    async def _drop_old_pins(self, unpinned: list[tuple[Instance, str]]) -> None:
        """Delete the entries of instances just given away from their gone worker's stream,
        which nobody reads any more: left there, each would stay for good (the streams would
        outgrow what is Enqueued). After the publish, so a stop in between leaves a harmless
        duplicate, never no entry. Should the worker come back meanwhile and read one first,
        it finds the instance unpinned: a claim is a compare-and-set either way."""
        by_worker: dict[str, list[UUID]] = defaultdict(list)
        for instance, worker_id in unpinned:
            by_worker[worker_id].append(instance.id)
        for worker_id, ids in sorted(by_worker.items()):
            try:
                await self.bus.drop_pinned(worker_id, ids)
            except BusUnavailableError as exc:
                # Harmless leftovers: a worker that reads one finds the instance unpinned.
                logger.warning(
                    "could not delete %d old entries from the stream of gone worker %s: %s",
                    len(ids),
                    worker_id,
                    exc,
                    extra={"action": "scheduler.old_pins_kept", "worker_id": worker_id},
                )

    async def _publish(self, instances: list[Instance], *, force: bool = False) -> None:
        await self.dispatcher.publish(instances, force=force)

    async def _republish(self, lost: list[Instance]) -> None:
        """Publish again instances whose message is gone (a copy still in a stream is not)."""
        self.metrics.count(SweepStep.REPUBLISHED, lost)
        await self._publish(lost, force=True)

    async def _enqueued_loop(self) -> None:
        """Publish what applications enqueued in their own transactions as soon as they
        commit (Postgres NOTIFY). Only a fast path: the sweep publishes never-published
        instances anyway, so a notification lost with its connection is no loss. While the
        database is away it listens again every second, warning once an outage (as the bus
        listeners do)."""
        outage = Outage("scheduler", "enqueued notifications", source="the database")
        while True:
            try:
                async for payloads in self.store.notifications(ENQUEUED_CHANNEL):
                    outage.delivered()
                    ids = self._announce_due(payloads)
                    if ids:
                        await self._publish(await self.store.unpublished_among(valid_ids(ids)))
                return  # this store has no notifications
            except UnavailableError as exc:
                outage.failed(exc, ENQUEUED_RELISTEN_S)
                await asyncio.sleep(ENQUEUED_RELISTEN_S)

    def _announce_due(self, payloads: list[str]) -> list[str]:
        """Take the run_at times announced on the channel (an instance made Scheduled: see
        migration 0023) for the sleep until the sweep; returns the other payloads (the ids of
        instances enqueued in applications' transactions)."""
        ids = []
        for payload in payloads:
            if not payload.startswith(DUE_PREFIX):
                ids.append(payload)
                continue
            try:
                epoch = float(payload.removeprefix(DUE_PREFIX))
                self._announced.append(datetime.fromtimestamp(epoch, UTC))
            except (ValueError, OverflowError):
                logger.warning(
                    "ignored an undecodable due-time notification %r",
                    payload[:64],
                    extra={"action": "scheduler.bad_notification"},
                )
        if self._announced:
            self._announcing.set()
        return ids

    async def _event_loop(self) -> None:
        """Definition edits reach the leader at once (the sweep's version check is the
        backstop if the event is lost). A lost term ends the duties (``NotLeaderError``)."""
        await listen(
            self.bus,
            self._on_definitions_changed,
            role="scheduler",
            what="definition edits",
            kinds={EventKind.DEFINITIONS_CHANGED},
            propagate=(NotLeaderError,),
        )

    async def _on_definitions_changed(self, event: Event) -> None:
        async with self._planning:
            await self._replan(await self.cache.apply_event(event))


def _lease_wakes(ends: list[datetime]) -> list[datetime]:
    """When to wake to release the leases that end at ``ends`` (sorted): each end is released
    within ``LEASE_WAKE_WINDOW`` after it, by as few wakes as that allows."""
    wakes: list[datetime] = []
    for end in ends:
        if not wakes or end >= wakes[-1]:
            wakes.append(end + LEASE_WAKE_WINDOW)
    return wakes
