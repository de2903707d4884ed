"""Runaways: sync jobs whose attempt ended (timeout, or fenced) while their code still runs in
a pool thread, which cannot be stopped from outside. Each keeps a worker slot, and its job's
concurrency slot if its Failed outcome was recorded holding it, until its thread returns.
"""

from __future__ import annotations

import asyncio
import logging
from uuid import UUID

from jobplane.dispatch import Dispatcher
from jobplane.domain.options import OnLimit
from jobplane.store.abc import WorkerStore
from jobplane_worker.attempt import Attempt
from jobplane_worker.metrics import WorkerMetrics
from jobplane_worker.retrying import retrying

# The role's logger, as for every part of the worker: operators filter on it.
logger = logging.getLogger("jobplane_worker.worker")


class Runaways:
    """The runaways of one worker, by lease; ``slot_freed`` is set when one lets go."""

    def __init__(
        self,
        store: WorkerStore,
        dispatcher: Dispatcher,
        metrics: WorkerMetrics,
        slot_freed: asyncio.Event,
    ) -> None:
        self.store = store
        self.dispatcher = dispatcher
        self.metrics = metrics
        self._slot_freed = slot_freed
        # Attempts recorded (or given up) while their sync code still runs in a pool thread,
        # by lease: each holds a worker slot until its thread returns (see hold).
        self._held: dict[tuple[UUID, int], asyncio.Task[None]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def watchers(self) -> list[asyncio.Task[None]]:
        """The tasks waiting for runaway threads (a drain waits for them)."""
        return list(self._held.values())

    def hold(self, attempt: Attempt, *, holds_slot: bool) -> None:
        """Keep a worker slot (and the heartbeat off the lease) for an attempt whose sync code
        still runs after its end, until the thread returns."""
        self.metrics.runaways.labels(job=attempt.claim.instance.job_key).inc()
        task = asyncio.create_task(
            self._await(attempt, holds_slot), name=f"runaway-{attempt.lease[0]}"
        )
        self._held[attempt.lease] = task

    async def _await(self, attempt: Attempt, holds_slot: bool) -> None:
        """Wait for a runaway's thread; discard what it returns or raises (its attempt has
        ended and every write of its token is refused); then give its job's slot back."""
        instance = attempt.claim.instance
        extra = {"instance_id": str(instance.id), "job_key": instance.job_key}
        assert attempt.code is not None
        try:
            try:
                await asyncio.shield(attempt.code)
                ended = "returned"
            except Exception as exc:
                ended = f"raised {type(exc).__name__}: {exc}"
            logger.warning(
                "runaway job %s (%s) %s at last; discarded",
                instance.job_key,
                instance.id,
                ended,
                extra={**extra, "action": "worker.runaway_returned"},
            )
            if holds_slot:
                await attempt.done.wait()  # the Failed outcome was written (or refused)
                await self._release_slot(attempt)
        finally:
            self._held.pop(attempt.lease, None)
            self._slot_freed.set()

    async def _release_slot(self, attempt: Attempt) -> None:
        instance = attempt.claim.instance
        # Fenced by (instance, claim token): a later attempt's slot is never touched, and if
        # the dead-worker sweep released it first this matches nothing. Retried until the store
        # answers: until then the slot stays held, which errs on the side of the limit.
        released: bool = await retrying(
            f"giving back the slot of runaway {instance.id}", None, self.metrics.backend_error
        )(self.store.release_runaway_slot, instance.id, attempt.claim.token)
        if released and attempt.claim.options.on_limit is OnLimit.WAIT:
            # An instance parked for this slot (the retry, perhaps) can run now.
            waiting = await self.store.republish_waiting([instance.job_key], 1)
            await self.dispatcher.publish(waiting, force=True)
