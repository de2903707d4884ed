"""The scheduler role: elect one leader; the leader fires cron ticks on the second, promotes
due instances, releases expired leases, republishes what the bus may have lost.

Every replica runs :class:`Scheduler`. It renews or takes the lease every third of its TTL;
while it holds it, :class:`LeaderDuties` run. Every write made as leader is fenced by the
lease's term in the store, so a deposed leader (paused, partitioned) writes nothing.
"""

from __future__ import annotations

import asyncio
import logging

from jobplane.bus.abc import Bus
from jobplane.bus.envelope import Event, EventKind
from jobplane.clock import Clock, StoreClock
from jobplane.domain.models import LeaderLease
from jobplane.errors import UnavailableError
from jobplane.events import listen
from jobplane.startup import freeze_startup_heap
from jobplane.store.abc import LeaderStore
from jobplane.tasks import cancel_and_wait
from jobplane_scheduler.duties import LeaderDuties
from jobplane_scheduler.metrics import SchedulerMetrics
from jobplane_scheduler.settings import SchedulerSettings

logger = logging.getLogger(__name__)


class Scheduler:
    """One scheduler replica. Does not own the store or the bus.

    ``clock`` is what the leader plans cron ticks against and sleeps on between them (the
    store's clock by default; tests drive their own). The lease campaign and the sweeps, whose
    work is judged in SQL by the database's clock, wait in real time."""

    def __init__(
        self,
        store: LeaderStore,
        bus: Bus,
        settings: SchedulerSettings,
        clock: Clock | None = None,
    ) -> None:
        self.store = store
        self.bus = bus
        self.settings = settings
        self.clock: Clock = clock or StoreClock(store)
        self.lease: LeaderLease | None = None
        self.metrics = SchedulerMetrics(lambda: self.lease)
        self._duties: asyncio.Task[None] | None = None
        #: The current term's duties (read-only use: :meth:`cached_definitions`).
        self._leader: LeaderDuties | None = None

    def cached_definitions(self) -> dict[str, tuple[int, bool]] | None:
        """The leader's definition cache as job key → (version, paused), for the probe server;
        ``None`` when this replica does not lead (a follower caches nothing). Reads memory
        only."""
        if self._leader is None or self._duties is None:
            return None
        return {k: (d.version, d.paused) for k, d in self._leader.cache.definitions.items()}

    async def run(self, stop: asyncio.Event) -> None:
        """Campaign until ``stop``; then hand leadership over at once (release the lease)."""
        renew_every = self.settings.lease_ttl_s / 3
        logger.info(
            "scheduler %s campaigning for shard %d",
            self.settings.scheduler_id,
            self.settings.shard,
            extra={"action": "scheduler.started"},
        )
        resigned = asyncio.Event()
        listener = asyncio.create_task(self._listen_for_resignations(resigned))
        freeze_startup_heap()
        try:
            while not stop.is_set():
                if listener.done():
                    # A dead listener stops the replica rather than leave it half alive.
                    raise RuntimeError("the resignation listener stopped") from (
                        None if listener.cancelled() else listener.exception()
                    )
                await self._campaign()
                resigned.clear()
                waits = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(resigned.wait())}
                _, pending = await asyncio.wait(
                    waits, timeout=renew_every, return_when=asyncio.FIRST_COMPLETED
                )
                for task in pending:
                    task.cancel()
        finally:
            await cancel_and_wait([listener])
            await self._resign()

    async def _listen_for_resignations(self, resigned: asyncio.Event) -> None:
        """A leader stopping on SIGTERM says so: followers campaign at once instead of waiting
        for the lease to run out (the lease is the backstop if the event is lost)."""

        async def on_resigned(event: Event) -> None:
            if self.lease is None:
                resigned.set()

        await listen(
            self.bus,
            on_resigned,
            role="scheduler",
            what="leader resignations",
            kinds={EventKind.LEADER_RESIGNED},
        )

    async def _campaign(self) -> None:
        s = self.settings
        try:
            lease = await self.store.acquire_leadership(s.shard, s.scheduler_id, s.lease_ttl_s)
        except UnavailableError as exc:
            logger.warning("cannot renew the lease: %s", exc, extra={"action": "scheduler.lease"})
            lease = None
            # The lease runs out by itself; stop acting as leader before it does.
        if self._duties is not None and self._duties.done():
            self._duties.result()  # a crashed duty loop stops the process, not half of it
        if lease is None or (self.lease is not None and lease.term != self.lease.term):
            await self._stop_duties()
        if lease is not None and self._duties is None:
            logger.info(
                "leading shard %d, term %d",
                lease.shard,
                lease.term,
                extra={"action": "scheduler.leading", "term": lease.term},
            )
            duties = LeaderDuties(
                self.store, self.bus, self.settings, lease, self.metrics, clock=self.clock
            )
            self._duties = asyncio.create_task(duties.run(), name="jobplane-leader")
            self._leader = duties
        self.lease = lease
        try:
            # Listed as a replica (leader or standby) for the dashboard. Nothing depends on it,
            # so it comes after the lease (never delaying a renewal or a takeover), and failing
            # to write it changes nothing.
            await self.store.scheduler_seen(s.shard, s.scheduler_id)
        except UnavailableError as exc:
            logger.debug("cannot record this replica: %s", exc)

    async def _stop_duties(self) -> None:
        if self._duties is None:
            return
        await cancel_and_wait([self._duties])
        self._duties = None
        self._leader = None
        logger.info("no longer leading", extra={"action": "scheduler.following"})

    async def _resign(self) -> None:
        await self._stop_duties()
        if self.lease is not None:
            try:
                await self.store.release_leadership(
                    self.lease.shard, self.lease.holder, self.lease.term
                )
                logger.info(
                    "released the lease of term %d",
                    self.lease.term,
                    extra={"action": "scheduler.resigned"},
                )
                await self.bus.publish_event(
                    Event(EventKind.LEADER_RESIGNED, {"shard": self.lease.shard})
                )
            except UnavailableError as exc:
                logger.warning(
                    "could not release the lease: %s", exc, extra={"action": "scheduler.resign"}
                )
            self.lease = None
        try:
            await self.store.scheduler_gone(self.settings.shard, self.settings.scheduler_id)
        except UnavailableError as exc:  # its row is pruned after an hour anyway
            logger.debug("cannot forget this replica: %s", exc)
