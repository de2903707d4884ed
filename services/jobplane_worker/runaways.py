"""Runaways: jobs whose attempt ended (timeout, or fenced) while their code still runs: in a
pool thread, which cannot be stopped from outside, or an async job that swallowed its
cancellation at its timeout. Each keeps a worker slot, and its job's concurrency slot if its
Failed outcome was recorded holding it, until its code returns.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any
from uuid import UUID

from jobplane.dispatch import Dispatcher
from jobplane.domain.models import Instance
from jobplane.domain.options import OnLimit
from jobplane.errors import StoreUnavailableError, UnavailableError
from jobplane.store.abc import WorkerStore
from jobplane_worker.attempt import Attempt, raised_by
from jobplane_worker.job_errors import describe
from jobplane_worker.metrics import WorkerMetrics
from jobplane_worker.retrying import SIDE_WRITE_RETRY_S, retrying

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
        # Attempts recorded (or given up) while their code still runs (a sync job's thread, an
        # async job's task), by lease: each one's watcher, until it has given the job's slot
        # back (see hold).
        self._held: dict[tuple[UUID, int], asyncio.Task[None]] = {}
        # Those whose code still runs: each holds a worker slot until its code returns
        # (not until the job's slot is given back: that write may wait out a store outage).
        self._threads: set[tuple[UUID, int]] = set()

    def __len__(self) -> int:
        return len(self._threads)

    def watchers(self) -> list[asyncio.Task[None]]:
        """The tasks waiting for runaways' code (a drain waits for them)."""
        return list(self._held.values())

    def hold(self, attempt: Attempt, *, holds_slot: bool) -> None:
        """Keep a worker slot (and the heartbeat off the lease) for an attempt whose code still
        runs after its end, until it returns."""
        self.metrics.runaways.labels(job=attempt.claim.instance.job_key).inc()
        task = asyncio.create_task(
            self._await(attempt, holds_slot), name=f"runaway-{attempt.lease[0]}"
        )
        self._held[attempt.lease] = task
        self._threads.add(attempt.lease)

    async def _await(self, attempt: Attempt, holds_slot: bool) -> None:
        """Wait for a runaway's code; discard what it returns or raises (its attempt has
        ended and every write of its token is refused); then give its job's slot back. Never
        ends in an error: nobody awaits this task (the drain only waits for it to end)."""
        instance = attempt.claim.instance
        extra = {"instance_id": str(instance.id), "job_key": instance.job_key}
        code = attempt.code
        assert code is not None
        try:
            try:
                await asyncio.shield(code)
            except BaseException:
                # Whatever the job's code raised (SystemExit too: asyncio would re-raise it
                # out of the event loop) is discarded below. Only this watcher's own cancel
                # (the worker is failing) goes on; the dead-worker sweep then frees the slot.
                if not code.done():
                    raise
            self._let_go(attempt)
            logger.warning(
                "runaway job %s (%s) %s at last; discarded",
                instance.job_key,
                instance.id,
                _how_it_ended(code),
                extra={**extra, "action": "worker.runaway_returned"},
            )
            if holds_slot:
                await attempt.done.wait()  # the Failed outcome was written (or refused)
                await self._release_slot(attempt)
        except Exception:
            # A fault of the worker's own (a store refusal, say): logged, never a task error
            # nobody retrieves. The slot stays held until the dead-worker sweep, or this
            # worker's next registration, gives it back.
            logger.exception(
                "could not give back the slot of runaway job %s (%s)",
                instance.job_key,
                instance.id,
                extra={**extra, "action": "worker.runaway_error"},
            )
        finally:
            self._held.pop(attempt.lease, None)
            self._let_go(attempt)

    def _let_go(self, attempt: Attempt) -> None:
        """The runaway's thread has returned (or is no longer waited for): its worker slot is
        free."""
        if attempt.lease in self._threads:
            self._threads.discard(attempt.lease)
            self._slot_freed.set()

    async def _release_slot(self, attempt: Attempt) -> None:
        instance = attempt.claim.instance
        # Fenced by (instance, claim token): a later attempt's slot is never touched, and if
        # the dead-worker sweep released it first this matches nothing. Retried until the store
        # answers: until then the slot stays held, which errs on the side of the limit.
        released: bool = await retrying(
            f"giving back the slot of runaway {instance.id}", None, self.metrics.backend_error
        )(self.store.release_runaway_slot, instance.id, attempt.claim.token)
        if not released or attempt.claim.options.on_limit is not OnLimit.WAIT:
            return
        # An instance parked for this slot (the retry, perhaps) can run now. Best effort, as
        # the recorder's republishing: retried for a while, then left to the sweep, which
        # republishes what is Enqueued and unpublished.
        deadline = time.monotonic() + SIDE_WRITE_RETRY_S
        try:
            waiting: list[Instance] = await retrying(
                f"republishing parked instances of {instance.job_key}",
                lambda: deadline,
                self.metrics.backend_error,
            )(self.store.republish_waiting, [instance.job_key], 1)
            await retrying(
                "marking instances published", lambda: deadline, self.metrics.backend_error
            )(self.dispatcher.publish, waiting, force=True)
        except UnavailableError as exc:
            if not isinstance(exc, StoreUnavailableError):  # a store error was counted by a try
                self.metrics.backend_error(exc)
            logger.warning(
                "republishing after the runaway %s let go of its slot failed: %s; left for the "
                "sweep",
                instance.id,
                exc,
                extra={
                    "action": "worker.republish_deferred",
                    "instance_id": str(instance.id),
                    "job_key": instance.job_key,
                },
            )


def _how_it_ended(code: asyncio.Future[Any]) -> str:
    """How a runaway's code ended, for the log (the job's exception may not even print)."""
    if code.cancelled():
        return "was cancelled"
    exc = raised_by(code)
    return "returned" if exc is None else f"raised {describe(exc)}"
