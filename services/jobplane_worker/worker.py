"""The worker role: consume queues, claim in batches, run jobs, record outcomes in batches.

Order of operations for one bus entry, and why:

1. read (batched XREADGROUP) — the entry is pending on this consumer;
2. claim in the store (one statement per batch) — from now on Postgres and the lease own it;
3. start the claimed instances, then ack + delete the entries — only after the claim
   committed, so a crash before it leaves the entries pending and another worker reclaims them.
   A failed ack does not hold the instances back: it is retried later, and an entry delivered
   again is dropped by the claim (its instance is no longer Enqueued);
4. run, heartbeat the lease, then record the outcome (batched, fenced by the claim token) —
   retried with backoff while the store is unreachable: an outcome is never dropped.

Once a stop is requested nothing more is claimed: a blocking read is abandoned, and a batch
a read returned anyway is left pending (the scheduler's sweep republishes an instance still
Enqueued; another worker reclaims the entry).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import random
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any
from uuid import UUID

from opentelemetry.context import Context
from tenacity import AsyncRetrying

from jobplane import __version__, telemetry
from jobplane.app import App, Resources
from jobplane.bus.abc import Bus, Consumer, Delivery
from jobplane.bus.envelope import EventKind
from jobplane.context import CheckpointNotSavedError, JobContext
from jobplane.dispatch import Dispatcher
from jobplane.domain.models import Claim, Instance, Outcome, WorkerInfo
from jobplane.domain.options import Isolation, OnLimit
from jobplane.domain.reasons import StopReason
from jobplane.domain.states import InstanceState
from jobplane.errors import (
    BusUnavailableError,
    StoreUnavailableError,
    UnavailableError,
    WorkerEvictedError,
)
from jobplane.settings import WorkerSettings
from jobplane.startup import wait_until_reachable
from jobplane.store.abc import Store
from jobplane.tasks import cancel_and_wait
from jobplane_worker.attempt import Attempt, run_attempt
from jobplane_worker.health import serving
from jobplane_worker.metrics import ClaimOutcome, FencedWrite, WorkerMetrics
from jobplane_worker.poison import complete_isolating_poison
from jobplane_worker.retrying import SIDE_WRITE_RETRY_S, retrying
from jobplane_worker.tracing import claim_spans, record_spans

logger = logging.getLogger(__name__)

#: A checkpoint stops being retried this long before the fence would stop its attempt.
FENCE_NOTICE_S = 0.1
#: How often a shutdown held up by job threads that ignore their cancellation says so.
SHUTDOWN_NAG_S = 30.0
#: Claims in flight at once: the next batch is read while the previous one is being claimed.
MAX_CLAIMS_IN_FLIGHT = 1
#: Entries of a job no live worker knows are put back every ``unknown_job_delay_s``; they are
#: logged once per job per this many seconds, with the count.
UNKNOWN_JOB_LOG_EVERY_S = 60.0


class Worker:
    """One worker process's engine. Does not own the store or the bus."""

    def __init__(self, app: App, store: Store, bus: Bus, settings: WorkerSettings) -> None:
        self.app = app
        self.store = store
        self.bus = bus
        self.settings = settings
        self.id = settings.worker_id
        self.running: dict[UUID, Attempt] = {}
        self._outcomes: asyncio.Queue[tuple[Attempt, Outcome]] = asyncio.Queue()
        self._slot_freed = asyncio.Event()
        self._side_tasks: set[asyncio.Task[Any]] = set()
        self._resources: Resources = {}
        self.dispatcher = Dispatcher(store, bus)
        self._pool = ThreadPoolExecutor(settings.concurrency, thread_name_prefix="jobplane-job")
        self._reserved = 0  # entries read and being claimed: they count against capacity
        self._last_reclaim = time.monotonic()
        self._failure: Exception | None = None
        self.registered = False  # read by the readiness probe
        self.stopping = False
        # Attempts recorded (or given up) while their sync code still runs in a pool thread,
        # by lease: each holds a worker slot until its thread returns (see _hold_runaway).
        self._runaways: dict[tuple[UUID, int], asyncio.Task[None]] = {}
        self.metrics = WorkerMetrics(
            settings.concurrency,
            lambda: len(self.running) + len(self._runaways),
            lambda: self.runaway_count,
        )
        #: Per running instance, a ``time.monotonic()`` until which its lease surely holds:
        #: ``lease_s`` after the claim or last renewal was sent.
        self._lease_until: dict[UUID, float] = {}
        #: Per unknown job key: when its put-backs were last logged, and how many since.
        self._unknown_logged: dict[str, tuple[float, int]] = {}

    @property
    def runaway_count(self) -> int:
        """Sync jobs whose attempt ended (timeout) while their code still holds a pool thread."""
        return len(self._runaways)

    # -- lifecycle -------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set, then stop gracefully (see :meth:`_drain`). With a health
        port, the probes answer from the start to the end of the drain."""
        async with contextlib.AsyncExitStack() as stack:
            watched: list[asyncio.Task[Any]] = []
            if self.settings.health_port:
                probes = serving(self, self.settings.health_host, self.settings.health_port)
                watched.append(await stack.enter_async_context(probes))
            await self._run_until(stop, watched)
        logger.info("worker %s stopped", self.id, extra={"action": "worker.stopped"})

    async def _run_until(self, stop: asyncio.Event, watched: list[asyncio.Task[Any]]) -> None:
        async with self.app.lifespan() as resources:
            self._resources = resources
            # Postgres may go away right after the startup check (a restart): registering is
            # idempotent, so an outage here is waited out as the startup wait does (up to
            # ``startup_timeout_s``, or until stopped), not a crash of the worker.
            await wait_until_reachable(
                self.register, "registration", self.settings.startup_timeout_s, stop
            )
            consumer = self.bus.consumer(self.id, self.settings.queues)
            side = [
                asyncio.create_task(self._record_loop(), name="jobplane-record"),
                asyncio.create_task(self._heartbeat_loop(), name="jobplane-heartbeat"),
                asyncio.create_task(self._fence_loop(), name="jobplane-fence"),
                asyncio.create_task(self._events_loop(), name="jobplane-events"),
            ]
            try:
                await self._consume(consumer, stop, [*side, *watched])
                self.stopping = True
                await self._drain()
                await self._outcomes.join()
            finally:
                self.stopping = True
                # Runaway watchers are left only when the worker fails (a drain waits for
                # them); their slots go back through the dead-worker sweep.
                await cancel_and_wait([*side, *self._side_tasks, *self._runaways.values()])
                self._pool.shutdown(wait=False, cancel_futures=True)
                await self._quietly(self.store.worker_stopped(self.id))

    async def register(self) -> None:
        """Register the app's jobs (first registration persists options) and this worker."""
        for spec in self.app.jobs.values():
            stored, created = await self.store.register_definition(
                spec.options, spec.args_schema(), actor=f"worker:{self.id}", app=self.app.name
            )
            if not created and stored.options != spec.options:
                # The stored options win (they may have been edited); report the drift.
                changed = sorted(
                    k
                    for k, v in spec.options.model_dump().items()
                    if stored.options.model_dump().get(k) != v
                )
                logger.warning(
                    "job %s: code options differ from the stored ones (%s); the stored ones apply",
                    spec.key,
                    ", ".join(changed),
                    extra={"action": "worker.options_drift", "job_key": spec.key},
                )
        await self.store.register_worker(
            WorkerInfo(
                id=self.id,
                host=socket.gethostname(),
                pid=os.getpid(),
                queues=tuple(self.settings.queues),
                capacity=self.settings.concurrency,
                version=__version__,
                jobs=tuple(sorted(self.app.jobs)),
            )
        )
        logger.info(
            "worker %s ready: queues %s, %d job(s), concurrency %d",
            self.id,
            ",".join(self.settings.queues),
            len(self.app.jobs),
            self.settings.concurrency,
            extra={"action": "worker.ready"},
        )
        self.registered = True

    # -- consuming -------------------------------------------------------------------------

    async def _consume(
        self, consumer: Consumer, stop: asyncio.Event, side: list[asyncio.Task[Any]]
    ) -> None:
        """Read batches no larger than the free capacity and claim them; the next read goes
        out while a claim is in flight (at most ``MAX_CLAIMS_IN_FLIGHT``)."""
        stopping = asyncio.ensure_future(stop.wait())
        inflight: set[asyncio.Task[None]] = set()
        try:
            while not stop.is_set():
                _raise_if_dead(side)
                if self._failure is not None:
                    raise RuntimeError("claiming a batch failed") from self._failure
                busy = len(self.running) + len(self._runaways) + self._reserved
                free = self.settings.concurrency - busy
                if free <= 0 or len(inflight) >= MAX_CLAIMS_IN_FLIGHT:
                    # The worker-wide limit holds back consumption; it never Skips.
                    await self._wait_for_room(stopping, inflight)
                    continue
                try:
                    deliveries = await self._read_or_stop(
                        consumer, min(free, self.settings.batch_size), stopping
                    )
                except UnavailableError as exc:
                    self._pause_warning(exc)
                    await asyncio.sleep(1)
                    continue
                if stop.is_set():
                    self._leave_unclaimed(deliveries)
                    break
                if deliveries:
                    self._reserved += len(deliveries)
                    task = asyncio.create_task(self._handle_reserved(consumer, deliveries))
                    inflight.add(task)
                    task.add_done_callback(inflight.discard)
        finally:
            stopping.cancel()
            await asyncio.gather(*inflight, return_exceptions=True)

    async def _read_or_stop(
        self, consumer: Consumer, count: int, stopping: asyncio.Future[Any]
    ) -> list[Delivery]:
        """The next batch, or nothing if a stop comes first. The read is then cancelled (Redis:
        the client closes the blocked connection, so the server hands nothing more to it; an
        entry it had already handed over stays pending on this consumer and is reclaimed)."""
        read = asyncio.ensure_future(self._next_batch(consumer, count))
        await asyncio.wait({read, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not read.done():
            read.cancel()
            await asyncio.gather(read, return_exceptions=True)
            return []
        return read.result()

    def _leave_unclaimed(self, deliveries: list[Delivery]) -> None:
        """Stopping: a batch read meanwhile is not claimed. Its entries stay pending on this
        consumer (another worker reclaims them after ``reclaim_idle_s``) and their instances
        stay Enqueued, which the scheduler's sweep republishes."""
        if deliveries:
            logger.info(
                "stopping: leaving %d entr(ies) unclaimed",
                len(deliveries),
                extra={"action": "worker.left_unclaimed"},
            )

    async def _next_batch(self, consumer: Consumer, count: int) -> list[Delivery]:
        """New entries, or, every ``reclaim_idle_s / 2``, entries idle on a silent consumer."""
        if time.monotonic() - self._last_reclaim >= self.settings.reclaim_idle_s / 2:
            self._last_reclaim = time.monotonic()
            return await consumer.reclaim(int(self.settings.reclaim_idle_s * 1000), count)
        return await consumer.read(count, self.settings.poll_ms)

    async def _wait_for_room(
        self, stopping: asyncio.Future[Any], inflight: set[asyncio.Task[None]]
    ) -> None:
        self._slot_freed.clear()
        freed = asyncio.ensure_future(self._slot_freed.wait())
        await asyncio.wait({stopping, freed, *inflight}, return_when=asyncio.FIRST_COMPLETED)
        freed.cancel()

    async def _handle_reserved(self, consumer: Consumer, deliveries: list[Delivery]) -> None:
        try:
            await self._handle(consumer, deliveries)
        except UnavailableError as exc:
            # Stop claiming while the store or bus is away; the unacked entries stay pending
            # and are reclaimed once it is back.
            self._pause_warning(exc)
            await asyncio.sleep(1)
        except Exception as exc:
            self._failure = exc  # a bug: stop the worker rather than run half alive
        finally:
            self._reserved -= len(deliveries)
            self._slot_freed.set()

    def _retrying(self, what: str, deadline: Callable[[], float] | None = None) -> AsyncRetrying:
        """:func:`retrying`, counting every failed try in the metrics."""
        return retrying(what, deadline, self.metrics.backend_error)

    def _pause_warning(self, exc: Exception) -> None:
        self.metrics.backend_error(exc)
        logger.warning("%s; retrying in 1 s", exc, extra={"action": "worker.unavailable"})

    async def _handle(self, consumer: Consumer, deliveries: list[Delivery]) -> None:
        if not deliveries:
            return
        known = [d for d in deliveries if d.envelope.job_key in self.app.jobs]
        unknown = [d for d in deliveries if d.envelope.job_key not in self.app.jobs]
        if unknown:
            self._spawn(self._requeue_later(consumer, unknown))
        if not known:
            return
        ids = list(dict.fromkeys(d.envelope.instance_id for d in known))
        sent = time.monotonic()  # the lease is counted from no earlier than this
        began_ns = time.time_ns()
        result = await self.store.claim(ids, self.id, self.settings.lease_s, self.app.jobs.keys())
        traces = claim_spans(known, result.claimed, self.id, began_ns)
        # The claim has committed: Postgres and the lease own these instances now. They start
        # whatever the bus does next: they must not wait, unrenewed, for the reaper.
        lease_until = sent + self.settings.lease_s
        for claim in result.claimed:
            self.metrics.claims.labels(job=claim.instance.job_key).inc()
            self.metrics.picked_up(claim.instance)
            if time.monotonic() >= lease_until - self._fence_margin(claim):
                # The claim's answer came so late (a partition or a stalled connection held
                # it) that the fence would stop the attempt at once: its lease may already
                # have ended and another worker may be running the instance. Its code never
                # starts; the reaper hands it on, and the claim token refuses our writes.
                self.metrics.lease_lost_writes.labels(write=FencedWrite.CLAIM).inc()
                logger.warning(
                    "claim of instance %s answered after its lease could end; not running it",
                    claim.instance.id,
                    extra={
                        "action": "worker.claim_too_late",
                        "instance_id": str(claim.instance.id),
                        "job_key": claim.instance.job_key,
                    },
                )
                continue
            self._start(claim, lease_until, traces.get(claim.instance.id))
        for instance_id in result.cancelled:
            logger.info(
                "instance %s not run: a cancel was requested",
                instance_id,
                extra={"action": "worker.cancelled_at_claim", "instance_id": str(instance_id)},
            )
        # The entries go (a long job is never re-delivered). Skipped, parked and stale ones too.
        try:
            await consumer.ack(known)
        except BusUnavailableError as exc:
            self.metrics.backend_error(exc)
            self._spawn(self._ack_later(consumer, known, exc))

    async def _ack_later(
        self, consumer: Consumer, deliveries: list[Delivery], error: BusUnavailableError
    ) -> None:
        """Retry a failed ack until the bus is back. Should the worker stop first, the entries
        stay pending and are reclaimed by a worker whose claim drops them: their instances are
        no longer Enqueued."""
        delay = 0.2
        while True:
            logger.warning(
                "ack of %d entr(ies) failed: %s; retrying in %.1f s",
                len(deliveries),
                error,
                delay,
                extra={"action": "worker.ack_retry"},
            )
            await asyncio.sleep(delay)
            try:
                await consumer.ack(deliveries)
                return
            except BusUnavailableError as exc:
                self.metrics.backend_error(exc)
                error, delay = exc, min(delay * 2, 5.0)

    async def _requeue_later(self, consumer: Consumer, deliveries: list[Delivery]) -> None:
        """Leave a job this worker does not know for a worker that does: forward it to a live
        worker that registered the job; if none is live, put it back after a delay (until then
        it stays pending here, so a crash loses nothing)."""
        by_key: dict[str, list[Delivery]] = {}
        for d in deliveries:
            by_key.setdefault(d.envelope.job_key, []).append(d)
        workers = await self.store.list_workers()
        now = await self.store.now()
        for key, group in by_key.items():
            live = [
                w.id
                for w in workers
                if key in w.jobs
                and w.id != self.id
                and w.stopped_at is None
                and w.heartbeat_at is not None
                and (now - w.heartbeat_at).total_seconds() < 3 * self.settings.heartbeat_s + 5
            ]
            if live:
                await consumer.forward(group, random.choice(live))
                logger.info(
                    "no job %s here; forwarded %d entr(ies) to a worker that knows it",
                    key,
                    len(group),
                    extra={"action": "worker.forward_unknown", "job_key": key},
                )
                continue
            self._log_unknown(key, len(group))
            await asyncio.sleep(self.settings.unknown_job_delay_s)
            # An instance no longer Enqueued (Terminated because no worker knows its job,
            # cancelled, claimed elsewhere) needs no message: its entry goes.
            enqueued = await self.store.still_enqueued({d.envelope.instance_id for d in group})
            await consumer.ack([d for d in group if d.envelope.instance_id not in enqueued])
            await consumer.requeue([d for d in group if d.envelope.instance_id in enqueued])

    def _log_unknown(self, key: str, entries: int) -> None:
        """One line per job and ``UNKNOWN_JOB_LOG_EVERY_S`` for entries put back, with the
        count since the last line (a backlog goes round every ``unknown_job_delay_s``)."""
        last, count = self._unknown_logged.get(key, (-UNKNOWN_JOB_LOG_EVERY_S, 0))
        count += entries
        now = time.monotonic()
        if now - last < UNKNOWN_JOB_LOG_EVERY_S:
            self._unknown_logged[key] = (last, count)
            return
        self._unknown_logged[key] = (now, 0)
        logger.info(
            "no live worker knows job %s; put %d entr(ies) back since the last line",
            key,
            count,
            extra={"action": "worker.unknown_job", "job_key": key},
        )

    # -- running ---------------------------------------------------------------------------

    def _start(self, claim: Claim, lease_until: float, trace: Context | None = None) -> None:
        instance = claim.instance
        ctx = JobContext(
            instance_id=instance.id,
            job_key=instance.job_key,
            attempt=instance.attempt,
            # When it was due: the cron occurrence, else run_at (delayed, retry), else created.
            scheduled_at=instance.scheduled_at or instance.run_at or instance.created_at,
            worker_id=self.id,
            last_checkpoint=instance.checkpoint,
            saver=functools.partial(self._save_checkpoint, claim),
            loop=asyncio.get_running_loop(),
        )
        attempt = Attempt(claim=claim, ctx=ctx, trace=trace)
        self.running[instance.id] = attempt
        self._lease_until[instance.id] = lease_until
        attempt.task = asyncio.create_task(self._run(attempt), name=f"job-{instance.id}")

    async def _save_checkpoint(self, claim: Claim, data: Any) -> bool:
        """Write a checkpoint, fenced by the claim token; retried while the store is
        unreachable and the lease may still hold. ``False``: refused, the lease was lost."""
        instance_id = claim.instance.id
        what = f"checkpoint of instance {instance_id} ({claim.instance.job_key})"

        def deadline() -> float:
            # Retried until just before the fence would stop the attempt, so the job hears
            # that its checkpoint was not saved (and may still return) rather than be stopped.
            attempt = self.running.get(instance_id)
            fence_at = self._fence_at(attempt) if attempt is not None else None
            return (fence_at or 0.0) - FENCE_NOTICE_S

        try:
            # The store's UPDATE has claim_token = token in its WHERE clause: after a lost lease
            # (another worker may have claimed the instance) this attempt's checkpoint is refused.
            saved: bool = await self._retrying(what, deadline)(
                self.store.save_checkpoint, instance_id, claim.token, data
            )
        except StoreUnavailableError as exc:
            raise CheckpointNotSavedError(
                f"instance {instance_id}: checkpoint not saved, the store stayed unreachable "
                f"until this attempt's lease could have expired ({exc})"
            ) from exc
        if not saved:
            self.metrics.lease_lost_writes.labels(write=FencedWrite.CHECKPOINT).inc()
        return saved

    async def _run(self, attempt: Attempt) -> None:
        key = attempt.claim.instance.job_key
        outcome: Outcome | None = None
        try:
            with telemetry.span("jobplane.run", attempt.trace, job=key):
                outcome = await run_attempt(
                    attempt,
                    self.app.jobs[key],
                    self._resources,
                    self._pool,
                    self.settings.timeout_grace_s,
                )
        except asyncio.CancelledError:
            pass  # stopped by _drain: released below
        finally:
            runaway = attempt.code_running
            if runaway:
                # Hold the worker slot before giving the running one up: never a moment
                # where the pool thread looks free.
                self._hold_runaway(attempt, holds_slot=outcome is not None)
            self.running.pop(attempt.claim.instance.id, None)
            self._slot_freed.set()
            lease_until = self._lease_until.pop(attempt.claim.instance.id, 0.0)
        if attempt.lease_lost:
            self.metrics.finished.labels(job=key, outcome=ClaimOutcome.LEASE_LOST).inc()
            return
        if outcome is None or (attempt.shutdown and outcome.reason != StopReason.TIMEOUT):
            # The worker is stopping and the code has stopped (it was cancelled, or noticed
            # the signal and returned): another worker runs it again.
            if not runaway:
                self.metrics.finished.labels(job=key, outcome=ClaimOutcome.RELEASED).inc()
                await self._release(attempt, lease_until)
            return
        if runaway:
            # Recorded now (Failed, timeout) without giving the job's slot back: its code still
            # runs, and max concurrency counts it until the thread returns.
            outcome = replace(outcome, holds_slot=True)
        await self._flush_progress(attempt)
        self.metrics.finished.labels(job=key, outcome=ClaimOutcome(outcome.state.value)).inc()
        self._outcomes.put_nowait((attempt, outcome))

    def _hold_runaway(self, attempt: Attempt, *, holds_slot: bool) -> None:
        """Keep a worker slot (and the heartbeat off the lease) for an attempt whose sync code
        still runs after its end, until the thread returns."""
        self.metrics.runaways.labels(job=attempt.claim.instance.job_key).inc()
        task = asyncio.create_task(
            self._await_runaway(attempt, holds_slot), name=f"runaway-{attempt.lease[0]}"
        )
        self._runaways[attempt.lease] = task

    async def _await_runaway(self, attempt: Attempt, holds_slot: bool) -> None:
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
                await self._release_runaway_slot(attempt)
        finally:
            self._runaways.pop(attempt.lease, None)
            self._slot_freed.set()

    async def _release_runaway_slot(self, attempt: Attempt) -> None:
        instance = attempt.claim.instance
        # Fenced by (instance, claim token): a later attempt's slot is never touched, and if
        # the dead-worker sweep released it first this matches nothing. Retried until the store
        # answers: until then the slot stays held, which errs on the side of the limit.
        released: bool = await self._retrying(f"giving back the slot of runaway {instance.id}")(
            self.store.release_runaway_slot, instance.id, attempt.claim.token
        )
        if released and attempt.claim.options.on_limit is OnLimit.WAIT:
            # An instance parked for this slot (the retry, perhaps) can run now.
            waiting = await self.store.republish_waiting([instance.job_key], 1)
            await self.dispatcher.publish(waiting, force=True)

    async def _release(self, attempt: Attempt, lease_until: float) -> None:
        """Processing → Enqueued (no retry used) on shutdown, once the code has stopped;
        retried while the store is unreachable and the lease may still hold (after that the
        reaper releases it, counting an unexpected retry). A refusal is logged, not retried."""
        instance = attempt.claim.instance
        try:
            # Fenced by the claim token and the Processing state: after a lost lease (the
            # reaper released it, another worker may run it) this changes nothing.
            released: Instance | None = await self._retrying(
                f"releasing instance {instance.id} ({instance.job_key})", lambda: lease_until
            )(
                self.store.transition,
                instance.id,
                InstanceState.ENQUEUED,
                expect=[InstanceState.PROCESSING],
                claim_token=attempt.claim.token,
                actor=self.id,
                reason=StopReason.SHUTDOWN,
            )
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
        await self._quietly(self.dispatcher.publish([released]))

    async def _flush_progress(self, attempt: Attempt) -> None:
        """Write progress reported since the last heartbeat before the outcome is recorded,
        so that the last report of a short attempt is not lost."""
        progress = attempt.ctx.pending_progress
        if progress is None:
            return
        instance_id = attempt.claim.instance.id
        try:
            # A heartbeat of this one lease: fenced by the claim token and the Processing
            # state, so a stale attempt (lease lost, instance re-claimed) writes nothing.
            kept = await self.store.heartbeat(
                [attempt.lease], self.settings.lease_s, {instance_id: progress}
            )
        except StoreUnavailableError as exc:
            self.metrics.backend_error(exc)
            logger.warning(
                "could not write the last progress of %s: %s",
                instance_id,
                exc,
                extra={"action": "worker.progress", "instance_id": str(instance_id)},
            )
            return
        if attempt.ctx.pending_progress == progress:
            attempt.ctx.pending_progress = None  # written; a newer report stays pending
        if instance_id not in kept:
            self.metrics.lease_lost_writes.labels(write=FencedWrite.PROGRESS).inc()

    async def _record_loop(self) -> None:
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
        ended: dict[UUID, InstanceState] = await complete_isolating_poison(
            self._retrying(f"recording {len(outcomes)} outcome(s)").wraps(self.store.complete),
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
                requeued.append(replace(instance, state=state))
            if attempt.claim.options.on_limit is OnLimit.WAIT and not outcome.holds_slot:
                # A slot freed (a runaway's goes back only when its thread returns).
                wait_keys[instance.job_key] = wait_keys.get(instance.job_key, 0) + 1
        try:
            await self._republish(requeued, wait_keys)
        except UnavailableError as exc:
            if not isinstance(exc, StoreUnavailableError):  # a store error was counted by a try
                self.metrics.backend_error(exc)
            # Not fatal: the outcomes are recorded; the sweep republishes what is Enqueued.
            logger.warning(
                "republishing after %d outcome(s) failed: %s; left for the sweep",
                len(batch),
                exc,
                extra={"action": "worker.republish_deferred"},
            )

    async def _republish(self, requeued: list[Instance], wait_keys: dict[str, int]) -> None:
        """Publish retries, and as many instances parked by ``on_limit=wait`` as slots were
        freed. Store writes are retried for a bounded time."""
        deadline = time.monotonic() + SIDE_WRITE_RETRY_S
        for key, freed in wait_keys.items():
            requeued.extend(
                await self._retrying(f"republishing parked instances of {key}", lambda: deadline)(
                    self.store.republish_waiting, [key], freed
                )
            )
        await self._retrying("marking instances published", lambda: deadline)(
            self.dispatcher.publish, requeued, force=True
        )

    # -- leases ----------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            try:
                if not await self.store.worker_heartbeat(self.id):
                    raise WorkerEvictedError(
                        f"worker {self.id} was marked stopped while it ran (paused or cut off "
                        "past the dead-worker threshold); stopping at once"
                    )
                await self._renew_leases()
            except StoreUnavailableError as exc:
                self.metrics.backend_error(exc)
                logger.warning("heartbeat failed: %s", exc, extra={"action": "worker.heartbeat"})

    async def _fence_loop(self) -> None:
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
                fence_at = self._fence_at(attempt)
                if fence_at is not None and now >= fence_at:
                    self._fence(attempt)

    def _fence_at(self, attempt: Attempt) -> float | None:
        """When (monotonic) the fence stops ``attempt`` unless its lease is renewed first."""
        until = self._lease_until.get(attempt.claim.instance.id)
        return None if until is None else until - self._fence_margin(attempt.claim)

    def _fence_margin(self, claim: Claim) -> float:
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

    async def _renew_leases(self) -> None:
        attempts = [a for a in self.running.values() if not (a.lease_lost or a.fenced)]
        if not attempts:
            return
        # Progress stays pending until a heartbeat has written it (a failed one loses nothing).
        progress = {
            a.claim.instance.id: a.ctx.pending_progress
            for a in attempts
            if a.ctx.pending_progress is not None
        }
        sent = time.monotonic()
        kept = await self.store.heartbeat(
            [a.lease for a in attempts], self.settings.lease_s, progress
        )
        for attempt in attempts:
            instance_id = attempt.claim.instance.id
            if instance_id in kept:
                self._lease_until[instance_id] = sent + self.settings.lease_s
                if attempt.ctx.pending_progress is progress.get(instance_id):
                    attempt.ctx.pending_progress = None  # written; a newer report would stay
            if instance_id not in kept:
                # Another worker may own it now; every write of ours would be refused anyway.
                attempt.lease_lost = True
                attempt.ctx.cancellation.set(StopReason.LEASE_LOST)
                self.metrics.lease_lost_writes.labels(write=FencedWrite.HEARTBEAT).inc()
                logger.warning(
                    "lost the lease of instance %s; stopping it",
                    instance_id,
                    extra={"action": "worker.lease_lost", "instance_id": str(instance_id)},
                )
            elif kept[instance_id]:
                attempt.ctx.cancellation.set(StopReason.CANCEL_REQUESTED)

    async def _events_loop(self) -> None:
        """Cancel requests reach the running attempt at once (the heartbeat is the backstop)."""
        while True:
            try:
                async for event in self.bus.subscribe():
                    if event.kind is not EventKind.CANCEL_REQUESTED:
                        continue
                    attempt = self.running.get(UUID(str(event.data.get("instance_id"))))
                    if attempt is not None:
                        attempt.ctx.cancellation.set(StopReason.CANCEL_REQUESTED)
            except (BusUnavailableError, ValueError) as exc:
                self.metrics.backend_error(exc)
                logger.warning(
                    "event subscription failed: %s; resubscribing",
                    exc,
                    extra={"action": "worker.events"},
                )
            await asyncio.sleep(1)  # the subscription ended: subscribe again

    # -- graceful stop ---------------------------------------------------------------------

    async def _drain(self) -> None:
        """Let running jobs finish within the grace period; then signal cancellation and
        release what stops (Processing → Enqueued, no retry used) for another worker.

        Never released while its code runs: a sync job's thread cannot be stopped, so an
        attempt whose thread ignores the signal stays Processing (its lease renewed) until the
        thread returns and is released then — or, if its timeout passes meanwhile, ends Failed
        as a runaway. The worker exits once every thread has returned."""
        tasks = [a.task for a in self.running.values() if a.task is not None]
        if tasks:
            logger.info(
                "stopping: waiting up to %g s for %d running job(s)",
                self.settings.grace_s,
                len(tasks),
                extra={"action": "worker.draining"},
            )
            await asyncio.wait(tasks, timeout=self.settings.grace_s)
        for attempt in list(self.running.values()):
            attempt.shutdown = True
            # Async jobs are cancelled by the signal itself; isolated ones get SIGTERM, then
            # SIGKILL after the grace (run_in_child); a sync job's thread can only be asked.
            attempt.ctx.cancellation.set(StopReason.SHUTDOWN)
            isolated = attempt.claim.options.isolation is Isolation.PROCESS
            if attempt.code is None and not isolated and attempt.task is not None:
                attempt.task.cancel()  # not started yet, or async
        await self._wait_for_code()

    async def _wait_for_code(self) -> None:
        """Wait until no attempt runs (each releases or records itself) and every runaway
        thread has returned; say so while threads hold the shutdown up."""
        while True:
            pending = [a.task for a in self.running.values() if a.task is not None]
            pending += list(self._runaways.values())
            if not pending:
                return
            threads = sum(a.code_running for a in self.running.values()) + len(self._runaways)
            if threads:
                logger.warning(
                    "shutdown waits on %d job thread(s) still running code that ignores its "
                    "cancellation; the worker exits once they return",
                    threads,
                    extra={"action": "worker.shutdown_waits_on_runaways"},
                )
            await asyncio.wait(pending, timeout=SHUTDOWN_NAG_S)

    # -- helpers ---------------------------------------------------------------------------

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    async def _quietly(self, coro: Any) -> None:
        try:
            await coro
        except UnavailableError as exc:
            self.metrics.backend_error(exc)
            logger.warning("%s", exc, extra={"action": "worker.cleanup"})


def _about(instance: Instance, action: str) -> dict[str, str]:
    return {"action": action, "instance_id": str(instance.id), "job_key": instance.job_key}


def _raise_if_dead(side: list[asyncio.Task[Any]]) -> None:
    """A dead side task (recorder, heartbeat) stops the worker instead of leaving it half alive."""
    for task in side:
        if task.done():
            exc = task.exception() if not task.cancelled() else None
            if isinstance(exc, WorkerEvictedError):
                raise exc  # as it is: the role exits at once on it
            raise RuntimeError(f"{task.get_name()} stopped") from exc
