"""The leases of the attempts a worker runs: renewed by its heartbeat, and a fence that stops
an attempt whose lease could not be renewed before the lease ends.

The heartbeat waits on the store; the fence never does, so a hung heartbeat cannot delay it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from uuid import UUID

from jobplane.context import pending_progress, progress_written
from jobplane.domain.models import Claim
from jobplane.domain.options import Isolation
from jobplane.domain.reasons import StopReason
from jobplane.errors import (
    StoreConflictError,
    StoreRefusedError,
    StoreUnavailableError,
    WorkerEvictedError,
)
from jobplane.store.abc import WorkerStore
from jobplane_worker.attempt import Attempt
from jobplane_worker.metrics import FencedWrite, WorkerMetrics
from jobplane_worker.settings import WorkerSettings

# The role's logger, as for every part of the worker: operators filter on it.
logger = logging.getLogger("jobplane_worker.worker")


Lease = tuple[UUID, int]  # (instance id, claim token): one attempt


class Leases:
    """Renews the leases of ``running`` (the worker's attempts by lease, shared with it) and
    fences off an attempt before a lease it could not renew ends."""

    def __init__(
        self,
        worker_id: str,
        store: WorkerStore,
        settings: WorkerSettings,
        metrics: WorkerMetrics,
        running: dict[Lease, Attempt],
    ) -> None:
        self.worker_id = worker_id
        self.store = store
        self.settings = settings
        self.metrics = metrics
        self.running = running
        #: Per running attempt (by lease: an instance claimed again by this worker while an
        #: earlier attempt of it still runs has two), a ``time.monotonic()`` until which its
        #: lease surely holds: ``lease_s`` after the claim or last renewal was sent.
        self._until: dict[Lease, float] = {}

    def track(self, lease: Lease, lease_until: float) -> None:
        """A claimed attempt starts: its lease holds until ``lease_until`` (monotonic)."""
        self._until[lease] = lease_until

    def forget(self, lease: Lease) -> float:
        """The attempt has ended: when its lease surely held until (0 if unknown)."""
        return self._until.pop(lease, 0.0)

    def lose(self, attempt: Attempt, why: str) -> None:
        """``attempt`` no longer holds its lease (another attempt may run the instance): stop
        it; nothing of it is written."""
        instance_id = attempt.claim.instance.id
        attempt.lease_lost = True
        attempt.ctx.cancellation.set(StopReason.LEASE_LOST)
        logger.warning(
            "lost the lease of instance %s (%s); stopping it",
            instance_id,
            why,
            extra={"action": "worker.lease_lost", "instance_id": str(instance_id)},
        )

    async def heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self._next_beat())
            try:
                if not await self.store.worker_heartbeat(self.worker_id):
                    raise WorkerEvictedError(
                        f"worker {self.worker_id} was marked stopped while it ran (paused or cut "
                        "off past the dead-worker threshold); stopping at once"
                    )
                await self._renew()
            except StoreUnavailableError as exc:
                self.metrics.backend_error(exc)
                logger.warning("heartbeat failed: %s", exc, extra={"action": "worker.heartbeat"})

    def _next_beat(self) -> float:
        """The pause before the next heartbeat: a quarter of one while a fenced attempt's
        code still runs here. The fence stops an attempt one heartbeat before its lease ends;
        at the usual pace, a store back right after the fence was reached by the next renewal
        only after the lease had ended (a heartbeat, then its round trip), and the reaper
        handed the instance to a second copy beside the code still running. Sooner, the
        renewal comes while the lease holds."""
        if any(a.fenced and not a.lease_lost for a in self.running.values()):
            return self.settings.heartbeat_s / 4
        return self.settings.heartbeat_s

    async def fence_loop(self) -> None:
        """Fence this worker off before its leases end: an attempt whose lease could not be
        renewed in time (the store is unreachable, a partition, a heartbeat stuck on a dead
        connection) is stopped while the lease still holds, so the reaper never hands the
        instance to another worker while this copy runs. Runs on its own, never waiting on the
        store: a hung heartbeat cannot delay it."""
        period = min(self.settings.heartbeat_s / 2, 0.5)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for attempt in list(self.running.values()):
                if attempt.lease_lost or attempt.fenced:
                    continue
                fence_at = self.fence_at(attempt)
                if fence_at is not None and now >= fence_at:
                    self._fence(attempt)

    def fence_at(self, attempt: Attempt) -> float | None:
        """When (monotonic) the fence stops ``attempt`` unless its lease is renewed first."""
        window = self.window(attempt)
        return None if window is None else window[0]

    def window(self, attempt: Attempt) -> tuple[float, float] | None:
        """(when the fence stops ``attempt``, when its lease surely holds until), both
        ``time.monotonic()``, unless renewed first; ``None`` once it is no longer tracked."""
        until = self._until.get(attempt.lease)
        return None if until is None else (until - self.fence_margin(attempt.claim), until)

    def fence_margin(self, claim: Claim) -> float:
        """How long before its lease ends an attempt is stopped: a heartbeat (the interval the
        fence loop and a last renewal need), plus the kill grace of an isolated child (SIGTERM,
        then SIGKILL ``timeout_grace_s`` later); never more than half the lease."""
        margin = self.settings.heartbeat_s
        if claim.options.isolation is Isolation.PROCESS:
            margin += self.settings.timeout_grace_s
        return min(margin, self.settings.lease_s / 2)

    def _fence(self, attempt: Attempt) -> None:
        instance_id = attempt.claim.instance.id
        # Stopped while the lease still holds. What it leaves is written as usual, fenced by
        # its claim token: a release (the code stopped) or an outcome (it had just ended) is
        # accepted if nobody has claimed the instance since, and refused otherwise.
        attempt.fenced = True
        attempt.ctx.cancellation.set(StopReason.LEASE_LOST)
        if attempt.code_running:
            # A sync job's thread cannot be stopped: it is reported, as any runaway.
            self.metrics.runaways.labels(job=attempt.claim.instance.job_key).inc()
            logger.error(
                "cannot renew the lease of instance %s and its sync code ignores the stop: "
                "runaway (another worker may run the instance once the lease ends)",
                instance_id,
                extra={
                    "action": "worker.fence_runaway",
                    "instance_id": str(instance_id),
                    "job_key": attempt.claim.instance.job_key,
                },
            )
        logger.warning(
            "cannot renew the lease of instance %s before it ends; stopping it",
            instance_id,
            extra={
                "action": "worker.fenced",
                "instance_id": str(instance_id),
                "job_key": attempt.claim.instance.job_key,
            },
        )

    async def _renew(self) -> None:
        # A fenced attempt is renewed too, for as long as it is running here: the fence only
        # asks its code to stop, and a sync job's thread (or an async job that finishes its
        # step first, an isolated child in its kill grace) may run on after it. Race: were it
        # left out, a store back before the lease ended still let the lease lapse under code
        # that ran on; the reaper released the instance and another worker started a second
        # copy beside it (max_concurrency=1 broken too). Renewed, the lease holds until the
        # code has stopped; then what it leaves is written, fenced by its token. Once a
        # heartbeat finds it lost, nothing of it is renewed or written.
        attempts = [a for a in self.running.values() if not a.lease_lost]
        if not attempts:
            return
        # Progress stays pending until a heartbeat has written it (a failed one loses nothing).
        progress = {
            a.claim.instance.id: pending
            for a in attempts
            if (pending := pending_progress(a.ctx)) is not None
        }
        sent = time.monotonic()
        kept = await self.store.heartbeat(
            [a.lease for a in attempts], self.settings.lease_s, progress
        )
        for attempt in attempts:
            if self.running.get(attempt.lease) is not attempt or attempt.lease_lost:
                # Race: it ended while the heartbeat was out (its outcome is being recorded,
                # which may be why its lease was not renewed), or this worker claimed the
                # instance again meanwhile (see Worker._start). The answer is not about a
                # running attempt: a signal now would cancel the recording of its outcome.
                continue
            instance_id = attempt.claim.instance.id
            if instance_id in kept:
                self._until[attempt.lease] = sent + self.settings.lease_s
                if (written := progress.get(instance_id)) is not None:
                    progress_written(attempt.ctx, written)  # a newer report stays pending
            if instance_id not in kept:
                # Another worker may own it now; every write of ours would be refused anyway.
                self.metrics.lease_lost_writes.labels(write=FencedWrite.HEARTBEAT).inc()
                self.lose(attempt, "its heartbeat was refused")
            elif kept[instance_id]:
                attempt.ctx.cancellation.set(StopReason.CANCEL_REQUESTED)

    async def flush_progress(self, attempt: Attempt) -> None:
        """Write progress reported since the last heartbeat before the outcome is recorded,
        so that the last report of a short attempt is not lost."""
        progress = pending_progress(attempt.ctx)
        if progress is None:
            return
        instance_id = attempt.claim.instance.id
        try:
            # A heartbeat of this one lease: fenced by the claim token and the Processing
            # state, so a stale attempt (lease lost, instance re-claimed) writes nothing.
            kept = await self.store.heartbeat(
                [attempt.lease], self.settings.lease_s, {instance_id: progress}
            )
        except (StoreUnavailableError, StoreConflictError, StoreRefusedError) as exc:
            # Best effort: the outcome is recorded next, whatever happened to its progress.
            self.metrics.backend_error(exc)
            logger.warning(
                "could not write the last progress of %s: %s",
                instance_id,
                exc,
                extra={"action": "worker.progress", "instance_id": str(instance_id)},
            )
            return
        progress_written(attempt.ctx, progress)  # a newer report stays pending
        if instance_id not in kept:
            self.metrics.lease_lost_writes.labels(write=FencedWrite.PROGRESS).inc()
