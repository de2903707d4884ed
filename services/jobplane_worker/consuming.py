"""Consuming: read the worker's queues in batches no larger than its free capacity, claim each
batch in the store, hand the claimed instances to the worker, acknowledge the entries.

Order for one bus entry, and why: read (batched XREADGROUP: the entry is pending on this
consumer); claim (one statement per batch: from then on Postgres and the lease own it); start
the claimed instances, then ack + delete the entries — only after the claim committed, so a
crash before it leaves the entries pending and another worker reclaims them. A failed ack does
not hold the instances back: it is retried later, and an entry delivered again is dropped by
the claim (its instance is no longer Enqueued).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Coroutine
from typing import Any

from opentelemetry.context import Context

from jobplane.app import App
from jobplane.bus.abc import Consumer, Delivery
from jobplane.domain.models import Claim
from jobplane.errors import BusUnavailableError, InstanceNotFoundError, UnavailableError
from jobplane.store.abc import WorkerStore
from jobplane_worker.metrics import FencedWrite, WorkerMetrics
from jobplane_worker.settings import WorkerSettings
from jobplane_worker.tracing import claim_spans

# The role's logger, as for every part of the worker: operators filter on it.
logger = logging.getLogger("jobplane_worker.worker")

#: Claims in flight at once: the next batch is read while the previous one is being claimed.
MAX_CLAIMS_IN_FLIGHT = 1
#: Entries of a job no live worker knows are put back every ``unknown_job_delay_s``; they are
#: logged once per job per this many seconds, with the count.
UNKNOWN_JOB_LOG_EVERY_S = 60.0

#: Starts a claimed instance: ``(claim, lease_until, trace)``, ``lease_until`` monotonic.
Start = Callable[[Claim, float, Context | None], None]


class Intake:
    """Reads and claims for one worker. Does not own the store or the bus.

    ``busy()`` counts the worker slots taken (running attempts and runaways); ``slot_freed``
    is set whenever one frees; ``fence_margin`` is the lease fence's (see
    :class:`~jobplane_worker.leases.Leases`); ``spawn`` runs a side task the worker stops."""

    def __init__(
        self,
        worker_id: str,
        app: App,
        store: WorkerStore,
        settings: WorkerSettings,
        metrics: WorkerMetrics,
        *,
        busy: Callable[[], int],
        slot_freed: asyncio.Event,
        fence_margin: Callable[[Claim], float],
        start: Start,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
    ) -> None:
        self.worker_id = worker_id
        self.app = app
        self.store = store
        self.settings = settings
        self.metrics = metrics
        self._busy = busy
        self._slot_freed = slot_freed
        self._fence_margin = fence_margin
        self._start = start
        self._spawn = spawn
        self._reserved = 0  # entries read and being claimed: they count against capacity
        self._last_reclaim = time.monotonic()
        #: A claim that failed with a bug: the worker stops rather than run half alive.
        self.failure: Exception | None = None
        #: Per unknown job key: when its put-backs were last logged, and how many since.
        self._unknown_logged: dict[str, tuple[float, int]] = {}
        #: Entries of jobs this worker does not know, waiting for the put-back task (at most
        #: one runs: see :meth:`_put_back`).
        self._unknown: list[Delivery] = []
        self._putting_back = False

    async def consume(
        self, consumer: Consumer, stop: asyncio.Event, check: Callable[[], None]
    ) -> None:
        """Read batches no larger than the free capacity and claim them; the next read goes
        out while a claim is in flight (at most ``MAX_CLAIMS_IN_FLIGHT``). ``check`` raises
        when the worker must stop at once (a dead side task)."""
        stopping = asyncio.ensure_future(stop.wait())
        inflight: set[asyncio.Task[None]] = set()
        try:
            while not stop.is_set():
                check()
                if self.failure is not None:
                    raise RuntimeError("claiming a batch failed") from self.failure
                free = self.settings.concurrency - self._busy() - self._reserved
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
            self.failure = exc  # a bug: stop the worker rather than run half alive
        finally:
            self._reserved -= len(deliveries)
            self._slot_freed.set()

    def _pause_warning(self, exc: Exception) -> None:
        self.metrics.backend_error(exc)
        logger.warning("%s; retrying in 1 s", exc, extra={"action": "worker.unavailable"})

    async def _handle(self, consumer: Consumer, deliveries: list[Delivery]) -> None:
        if not deliveries:
            return
        known = [d for d in deliveries if d.envelope.job_key in self.app.jobs]
        unknown = [d for d in deliveries if d.envelope.job_key not in self.app.jobs]
        if unknown:
            self._put_back(consumer, unknown)
        if not known:
            return
        ids = list(dict.fromkeys(d.envelope.instance_id for d in known))
        sent = time.monotonic()  # the lease is counted from no earlier than this
        began_ns = time.time_ns()
        result = await self.store.claim(
            ids, self.worker_id, self.settings.lease_s, self.app.jobs.keys()
        )
        traces = claim_spans(known, result.claimed, self.worker_id, began_ns)
        # The claim has committed: Postgres and the lease own these instances now. They start
        # whatever the bus does next: they must not wait, unrenewed, for the reaper.
        lease_until = sent + self.settings.lease_s
        for claim in result.claimed:
            self.metrics.claimed(claim.instance.job_key)
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
        # The attempts take their first step first: the ack's pipeline (its CPU, its send) came
        # before every job's start, 0.1 ms of the 0.28 from the claim's answer to the job's code
        # at p50 (docs/benchmarks.md). An entry acked a step later is only pending a step longer.
        await asyncio.sleep(0)
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

    def _put_back(self, consumer: Consumer, deliveries: list[Delivery]) -> None:
        """Hand entries of unknown jobs to the one put-back task, starting it if none runs.
        Entries read while it waits go in its next round: however the reads split them (a
        read woken by one entry returns that entry alone), they are put back in few batches,
        each within two put-back delays of being read."""
        self._unknown.extend(deliveries)
        if not self._putting_back:
            self._putting_back = True
            self._spawn(self._put_back_rounds(consumer))

    async def _put_back_rounds(self, consumer: Consumer) -> None:
        try:
            while self._unknown:
                group, self._unknown = self._unknown, []
                # A round that fails (the store or the bus away) leaves its entries pending
                # on this consumer: they are reclaimed after ``reclaim_idle_s``, as before.
                with contextlib.suppress(UnavailableError):
                    await self._requeue_later(consumer, group)
        finally:
            self._putting_back = False

    async def _requeue_later(self, consumer: Consumer, deliveries: list[Delivery]) -> None:
        """Leave a job this worker does not know for a worker that does: forward it to a live
        worker that registered the job and consumes its queue; if none is live, put it back
        after a delay (until then it stays pending here, so a crash loses nothing). An entry
        pinned to this worker is never forwarded: another worker's claim refuses a pinned
        instance (and acks the entry: it was republished here and forwarded again, for ever).
        It waits here; the leader's sweep unpins or ends an instance pinned to a worker that
        does not know its job (``pin_fallback``)."""
        by_key: dict[tuple[str, str | None], list[Delivery]] = {}
        for d in deliveries:
            queue = None if d.envelope.pinned_worker is not None else await self._queue_of(d)
            by_key.setdefault((d.envelope.job_key, queue), []).append(d)
        workers = await self.store.list_workers()
        now = await self.store.now()
        waiting: list[Delivery] = []
        for (key, queue), group in by_key.items():
            # Only a worker that consumes the queue: one that does not ran the instance all the
            # same (its claim does not look at queues), a gpu job on a cpu pool in a rollout.
            live = [
                w.id
                for w in workers
                if key in w.jobs
                and queue in w.queues
                and w.id != self.worker_id
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
            waiting += group
        if not waiting:
            return
        # One wait per round, not one per job: a round of many unknown jobs outlasted
        # ``reclaim_idle_s``, and this worker's reclaim handed it its own entries again.
        await asyncio.sleep(self.settings.unknown_job_delay_s)
        # An instance no longer Enqueued (Terminated because no worker knows its job,
        # cancelled, claimed elsewhere) needs no message: its entry goes.
        enqueued = await self.store.still_enqueued({d.envelope.instance_id for d in waiting})
        await consumer.ack([d for d in waiting if d.envelope.instance_id not in enqueued])
        await consumer.requeue([d for d in waiting if d.envelope.instance_id in enqueued])

    async def _queue_of(self, delivery: Delivery) -> str | None:
        """The queue of an unpinned entry: its stream's, or, in this worker's own stream
        (forwarded here), its instance's (``None`` if it is gone: the entry is acked later)."""
        if delivery.queue is not None:
            return delivery.queue
        try:
            return (await self.store.get_instance(delivery.envelope.instance_id)).queue
        except InstanceNotFoundError:
            return None

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
