"""Recording how attempts ended: outcomes in batches (fenced by the claim token, retried while
the store is unreachable, one that cannot be stored parked as a failure and logged: an outcome
is never dropped silently), releases (on shutdown, or of an attempt the fence stopped: counted
as the reaper counts an expired lease), and the republishing that follows (retries, instances
parked for a freed slot).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable
from dataclasses import replace
from typing import Any
from uuid import UUID

from jobplane.dispatch import Dispatcher
from jobplane.domain.models import Instance, Outcome
from jobplane.domain.options import OnLimit
from jobplane.domain.reasons import StopReason
from jobplane.domain.states import InstanceState
from jobplane.errors import StoreUnavailableError, UnavailableError
from jobplane.store.abc import WorkerStore
from jobplane_worker.attempt import Attempt
from jobplane_worker.metrics import FencedWrite, WorkerMetrics
from jobplane_worker.poison import complete_isolating_poison
from jobplane_worker.retrying import SIDE_WRITE_RETRY_S, retrying
from jobplane_worker.settings import WorkerSettings
from jobplane_worker.tracing import record_spans

# The role's logger, as for every part of the worker: operators filter on it.
logger = logging.getLogger("jobplane_worker.worker")


class Recorder:
    """Writes the end of this worker's attempts. Does not own the store or the bus."""

    def __init__(
        self,
        worker_id: str,
        store: WorkerStore,
        dispatcher: Dispatcher,
        settings: WorkerSettings,
        metrics: WorkerMetrics,
    ) -> None:
        self.worker_id = worker_id
        self.store = store
        self.dispatcher = dispatcher
        self.settings = settings
        self.metrics = metrics
        self._outcomes: asyncio.Queue[tuple[Attempt, Outcome]] = asyncio.Queue()

    def put(self, attempt: Attempt, outcome: Outcome) -> None:
        """Queue an outcome for :meth:`record_loop`; ``attempt.done`` is set once written."""
        self._outcomes.put_nowait((attempt, outcome))

    async def join(self) -> None:
        """Wait until every queued outcome was written (or refused)."""
        await self._outcomes.join()

    async def record_loop(self) -> None:
        """Record outcomes in batches: whatever is ready, never waiting to fill a batch."""
        while True:
            batch = [await self._outcomes.get()]
            while not self._outcomes.empty() and len(batch) < self.settings.batch_size:
                batch.append(self._outcomes.get_nowait())
            try:
                await self._record(batch)
            finally:
                for attempt, _ in batch:
                    attempt.done.set()
                    self._outcomes.task_done()

    async def _record(self, batch: list[tuple[Attempt, Outcome]]) -> None:
        outcomes = [outcome for _, outcome in batch]
        began_ns = time.time_ns()
        # An outcome the store cannot record (refused, or failing on this side) is isolated
        # and parked there, never raised: the loop must outlive any one outcome's data.
        ended: dict[UUID, InstanceState] = await complete_isolating_poison(
            retrying(
                f"recording {len(outcomes)} outcome(s)", None, self.metrics.backend_error
            ).wraps(self.store.complete),
            outcomes,
            self.metrics.backend_error,
        )
        record_spans(batch, ended, began_ns)
        requeued: list[Instance] = []
        wait_keys: dict[str, int] = {}
        for attempt, outcome in batch:
            instance = attempt.claim.instance
            state = ended.get(outcome.instance_id)
            if state is None:
                self.metrics.lease_lost_writes.labels(write=FencedWrite.OUTCOME).inc()
                continue  # fenced off: the store logged it
            logger.info(
                "instance %s of %s ended %s",
                instance.id,
                instance.job_key,
                state.value,
                extra={
                    "action": "worker.recorded",
                    "instance_id": str(instance.id),
                    "job_key": instance.job_key,
                    "state": state.value,
                },
            )
            if state is InstanceState.ENQUEUED:
                requeued.append(self._retry_of(attempt, state))
            if attempt.claim.options.on_limit is OnLimit.WAIT and not outcome.holds_slot:
                # A slot freed (a runaway's goes back only when its thread returns).
                wait_keys[instance.job_key] = wait_keys.get(instance.job_key, 0) + 1
        try:
            await self._republish(requeued, wait_keys)
        except Exception as exc:
            if not isinstance(exc, StoreUnavailableError):  # a store error was counted by a try
                self.metrics.backend_error(exc)
            # Not fatal: the outcomes are recorded; the sweep republishes what is Enqueued.
            # Whatever failed (an outage, a refusal, a bug), stopping the record loop for it
            # would strand every outcome queued behind this batch. Only an outage is expected:
            # anything else is logged with its traceback.
            logger.log(
                logging.WARNING if isinstance(exc, UnavailableError) else logging.ERROR,
                "republishing after %d outcome(s) failed: %s; left for the sweep",
                len(batch),
                exc,
                exc_info=None if isinstance(exc, UnavailableError) else exc,
                extra={"action": "worker.republish_deferred"},
            )

    def _retry_of(self, attempt: Attempt, state: InstanceState) -> Instance:
        """The retry the store made of ``attempt``, as it stored it: kept to this worker if the
        job's ``retry_on_same_worker`` says so. The claim-time copy has no pin: its message
        went to the queue, where another worker read it, could not claim it (pinned here) and
        dropped it, and the retry waited for the sweep's republish. (Were the option edited
        between the claim and the outcome, the sweep still republishes the row as stored.)"""
        instance = attempt.claim.instance
        if attempt.claim.options.retry_on_same_worker:
            return replace(instance, state=state, pinned_worker=self.worker_id)
        return replace(instance, state=state)

    async def _republish(self, requeued: list[Instance], wait_keys: dict[str, int]) -> None:
        """Publish retries, and as many instances parked by ``on_limit=wait`` as slots were
        freed. WorkerStore writes are retried for a bounded time."""
        if not requeued and not wait_keys:
            return  # most batches: no retry, no parked job (and no retry machinery to build)
        deadline = time.monotonic() + SIDE_WRITE_RETRY_S
        for key, freed in wait_keys.items():
            requeued.extend(
                await retrying(
                    f"republishing parked instances of {key}",
                    lambda: deadline,
                    self.metrics.backend_error,
                )(self.store.republish_waiting, [key], freed)
            )
        await retrying("marking instances published", lambda: deadline, self.metrics.backend_error)(
            self.dispatcher.publish, requeued, force=True
        )

    async def release(self, attempt: Attempt, lease_until: float) -> None:
        """Processing → Enqueued (no retry used) once the code has stopped, on shutdown or
        because the attempt was fenced (its lease could not be renewed in time: the reason
        then says "lease lost", and one unexpected retry is counted, as the reaper counts an
        expired lease: Terminated once they are used up, Cancelled if a cancel is pending);
        retried while the store is unreachable and the lease may still hold (after that the
        reaper releases it, counting an unexpected retry). A refusal is logged, not retried."""
        instance = attempt.claim.instance
        # Fenced by the claim token and the Processing state: after a lost lease (the reaper
        # released it, another worker may run it) this changes nothing.
        if attempt.fenced:
            # Counted: uncounted, a job that always outlives the fence (an async job blocking
            # its loop for most of the lease) was released and run again for ever.
            write = functools.partial(
                self.store.release_fenced,
                instance.id,
                attempt.claim.token,
                actor=self.worker_id,
                reason=StopReason.LEASE_LOST,
            )
        else:
            write = functools.partial(
                self.store.transition,
                instance.id,
                InstanceState.ENQUEUED,
                expect=[InstanceState.PROCESSING],
                claim_token=attempt.claim.token,
                actor=self.worker_id,
                reason=StopReason.SHUTDOWN,
            )
        try:
            released: Instance | None = await retrying(
                f"releasing instance {instance.id} ({instance.job_key})",
                lambda: lease_until,
                self.metrics.backend_error,
            )(write)
        except StoreUnavailableError as exc:
            logger.warning(
                "could not release instance %s of %s: %s; the reaper will once its lease expires",
                instance.id,
                instance.job_key,
                exc,
                extra=_about(instance, "worker.release_failed"),
            )
            return
        if released is None:
            logger.warning(
                "instance %s of %s not released: this worker no longer holds it",
                instance.id,
                instance.job_key,
                extra=_about(instance, "worker.release_refused"),
            )
            return
        if released.state is not InstanceState.ENQUEUED:
            logger.warning(
                "instance %s of %s ended %s instead of being released (%s)",
                instance.id,
                instance.job_key,
                released.state.value,
                released.reason,
                extra=_about(instance, "worker.release_ended"),
            )
            return
        await quietly(self.dispatcher.publish([released]), self.metrics)


async def quietly(write: Awaitable[Any], metrics: WorkerMetrics) -> None:
    """Await a write whose failure only delays things (a backstop does it later): an
    unavailable store or bus is counted and logged, not raised."""
    try:
        await write
    except UnavailableError as exc:
        metrics.backend_error(exc)
        logger.warning("%s", exc, extra={"action": "worker.cleanup"})


def _about(instance: Instance, action: str) -> dict[str, str]:
    return {"action": action, "instance_id": str(instance.id), "job_key": instance.job_key}
