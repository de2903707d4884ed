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

Once a stop is requested nothing more is claimed: a blocking read is abandoned, a batch read
anyway is left pending (the sweep republishes its instances; another worker reclaims it).

Parts: :mod:`~jobplane_worker.consuming` (steps 1-3), :mod:`~jobplane_worker.leases` (the
heartbeat, the fence), :mod:`~jobplane_worker.recording` (step 4's writes, releases) and
:mod:`~jobplane_worker.runaways` (code past its outcome); :class:`Worker` runs the attempts.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any
from uuid import UUID

from opentelemetry.context import Context

from jobplane import __version__, telemetry
from jobplane.app import App, Resources
from jobplane.bus.abc import Bus
from jobplane.bus.envelope import Event, EventKind
from jobplane.context import CheckpointNotSavedError, JobContext, bind_worker
from jobplane.dispatch import Dispatcher
from jobplane.domain.models import Claim, Outcome, WorkerInfo
from jobplane.domain.options import Isolation
from jobplane.domain.reasons import StopReason
from jobplane.errors import (
    StoppedWhileStarting,
    StoreUnavailableError,
    WorkerEvictedError,
    WorkerFailedError,
)
from jobplane.events import listen
from jobplane.startup import freeze_startup_heap, wait_until_reachable
from jobplane.store.abc import WorkerStore
from jobplane.tasks import cancel_and_wait
from jobplane_worker.attempt import Attempt, Ending, ending, run_attempt
from jobplane_worker.consuming import Intake
from jobplane_worker.leases import Lease, Leases
from jobplane_worker.metrics import AttemptEnd, FencedWrite, WorkerMetrics
from jobplane_worker.recording import Recorder, quietly
from jobplane_worker.retrying import retrying
from jobplane_worker.runaways import Runaways
from jobplane_worker.settings import WorkerSettings

logger = logging.getLogger(__name__)

#: A checkpoint stops being retried this long before the fence would stop its attempt.
FENCE_NOTICE_S = 0.1
#: How often a shutdown held up by job threads that ignore their cancellation says so.
SHUTDOWN_NAG_S = 30.0


class Worker:
    """One worker process's engine. Does not own the store or the bus."""

    def __init__(self, app: App, store: WorkerStore, bus: Bus, settings: WorkerSettings) -> None:
        self.app = app
        self.store = store
        self.bus = bus
        self.settings = settings
        self.id = settings.worker_id
        #: Every attempt whose task runs, by lease: an instance the reaper released while its
        #: attempt still ran here, and that this worker claimed again, has two at once.
        self.running: dict[Lease, Attempt] = {}
        #: The attempt of each instance that holds its lease, as far as this worker knows (the
        #: latest claim): the one a cancel request is for.
        self._current: dict[UUID, Attempt] = {}
        #: Cancel requests for instances claimed here that came before the claim's answer, by
        #: when they came (see :meth:`_on_cancel_requested`).
        self._early_cancels: dict[UUID, float] = {}
        self._slot_freed = asyncio.Event()
        self._side_tasks: set[asyncio.Task[Any]] = set()
        self._resources: Resources = {}
        self.dispatcher = Dispatcher(store, bus)
        self._pool = ThreadPoolExecutor(settings.concurrency, thread_name_prefix="jobplane-job")
        self.registered = False  # read by the readiness probe
        self.stopping = False
        self.metrics = WorkerMetrics(
            settings.concurrency,
            lambda: len(self.running) + len(self.runaways),
            lambda: self.runaway_count,
        )
        self.runaways = Runaways(store, self.dispatcher, self.metrics, self._slot_freed)
        self.leases = Leases(self.id, store, settings, self.metrics, self.running)
        self.recorder = Recorder(self.id, store, self.dispatcher, settings, self.metrics)
        self.intake = Intake(
            self.id,
            app,
            store,
            settings,
            self.metrics,
            busy=lambda: len(self.running) + len(self.runaways),
            slot_freed=self._slot_freed,
            fence_margin=self.leases.fence_margin,
            start=self._start,
            spawn=self._spawn,
        )

    def attempt_of(self, instance_id: UUID) -> Attempt | None:
        """The attempt of ``instance_id`` that runs here under its current claim, if any."""
        return self._current.get(instance_id)

    @property
    def runaway_count(self) -> int:
        """Jobs whose attempt ended (timeout) while their code still runs: a sync job in a pool
        thread, an async one that swallows its cancellation."""
        return len(self.runaways)

    # -- lifecycle -------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set, then stop gracefully (see :meth:`_drain`). With a health
        port, the probes answer from the start to the end of the drain."""
        async with contextlib.AsyncExitStack() as stack:
            watched: list[asyncio.Task[Any]] = []
            if self.settings.health_port:
                # Starlette and uvicorn are loaded for a probe port only: a plain worker
                # never carries them.
                from jobplane_worker.health import serving

                probes = serving(self, self.settings.health_host, self.settings.health_port)
                watched.append(await stack.enter_async_context(probes))
            with contextlib.suppress(StoppedWhileStarting):  # (told to stop while it started)
                await self._run_until(stop, watched)
        logger.info("worker %s stopped", self.id, extra={"action": "worker.stopped"})

    async def _run_until(self, stop: asyncio.Event, watched: list[asyncio.Task[Any]]) -> None:
        async with self.app.lifespan(stop) as resources:
            self._resources = resources
            # Postgres may go away right after the startup check (a restart): registering is
            # idempotent, so an outage here is waited out as the startup wait does (up to
            # ``startup_timeout_s``, or until stopped), not a crash of the worker.
            await wait_until_reachable(
                self.register, "registration", self.settings.startup_timeout_s, stop
            )
            freeze_startup_heap()
            consumer = self.bus.consumer(self.id, self.settings.queues)
            side = [
                asyncio.create_task(self.recorder.record_loop(), name="jobplane-record"),
                asyncio.create_task(self.leases.heartbeat_loop(), name="jobplane-heartbeat"),
                asyncio.create_task(self.leases.fence_loop(), name="jobplane-fence"),
                asyncio.create_task(self._events_loop(), name="jobplane-events"),
            ]
            failure: BaseException | None = None
            try:
                await self.intake.consume(
                    consumer, stop, functools.partial(_raise_if_dead, [*side, *watched])
                )
                self.stopping = True
                await self._drain()
                await self.recorder.join()
            except BaseException as exc:
                failure = exc
                raise
            finally:
                self.stopping = True
                # Attempts and runaways are left only when the worker fails (a drain waits
                # for them).
                stranded = len(self.running) + self.runaway_count
                await cancel_and_wait([*side, *self._side_tasks, *self.runaways.watchers()])
                self._pool.shutdown(wait=False, cancel_futures=True)
                if failure is None or not stranded:
                    await quietly(self.store.worker_stopped(self.id), self.metrics)
                elif not isinstance(failure, WorkerEvictedError | asyncio.CancelledError):
                    # Not marked stopped: the leader would give their rows and slots to other
                    # workers at once, beside code that still runs here (the process lived on
                    # until its pool threads returned). The role exits at once on this.
                    logger.error(
                        "worker failed with %d job(s) still running; exiting at once",
                        stranded,
                        exc_info=failure,
                        extra={"action": "worker.failed"},
                    )
                    raise WorkerFailedError(
                        f"worker {self.id} failed with {stranded} job(s) still running in it "
                        f"({failure!r}); exiting at once: its attempts are left to their leases"
                    ) from failure

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

    # -- running ---------------------------------------------------------------------------

    def _start(self, claim: Claim, lease_until: float, trace: Context | None = None) -> None:
        instance = claim.instance
        ctx = bind_worker(
            JobContext(
                instance_id=instance.id,
                job_key=instance.job_key,
                attempt=instance.attempt,
                # When it was due: the cron occurrence, else run_at (delayed, retry), else
                # created.
                scheduled_at=instance.scheduled_at or instance.run_at or instance.created_at,
                worker_id=self.id,
                last_checkpoint=instance.checkpoint,
            ),
            saver=functools.partial(self._save_checkpoint, claim),
            loop=asyncio.get_running_loop(),
        )
        attempt = Attempt(claim=claim, ctx=ctx, trace=trace)
        attempt.lease_window = functools.partial(self.leases.window, attempt)
        earlier = self._current.get(instance.id)
        if earlier is not None:
            # Race: the reaper released the instance while an attempt of it still ran here
            # (this worker was frozen or cut off past the lease, or a job blocked the loop),
            # and this worker claimed it again. That claim took a new token: the earlier
            # attempt's lease is gone. Stopped now, not at the next heartbeat, whose answer
            # (by instance) would read the new attempt's renewal as the earlier one's.
            self.leases.lose(earlier, "claimed again by this worker")
        self._current[instance.id] = attempt
        if self._early_cancels.pop(instance.id, None) is not None:
            ctx.cancellation.set(StopReason.CANCEL_REQUESTED)
        self.running[attempt.lease] = attempt
        self.leases.track(attempt.lease, lease_until)
        attempt.task = asyncio.create_task(self._run(attempt), name=f"job-{instance.id}")

    def _forget(self, attempt: Attempt) -> float:
        """``attempt`` has ended: forget it, and only it (the instance may have been claimed
        again meanwhile, see :meth:`_start`); when its lease surely held until."""
        self.running.pop(attempt.lease, None)
        if self._current.get(attempt.claim.instance.id) is attempt:
            del self._current[attempt.claim.instance.id]
        self._slot_freed.set()
        return self.leases.forget(attempt.lease)

    async def _save_checkpoint(self, claim: Claim, data: Any) -> bool:
        """Write a checkpoint, fenced by the claim token; retried while the store is
        unreachable and the lease may still hold. ``False``: refused, the lease was lost."""
        instance_id = claim.instance.id
        what = f"checkpoint of instance {instance_id} ({claim.instance.job_key})"

        def deadline() -> float:
            # Retried until just before the fence would stop the attempt, so the job hears
            # that its checkpoint was not saved (and may still return) rather than be stopped.
            attempt = self.running.get((instance_id, claim.token))
            fence_at = self.leases.fence_at(attempt) if attempt is not None else None
            return (fence_at or 0.0) - FENCE_NOTICE_S

        async def one_try() -> bool:
            # Each try ends by the deadline too. One sent on a connection a partition cut hears
            # nothing back (until the command timeout, 35 s by default): a sync job blocked in
            # checkpoint_sync meanwhile, which the fence cannot interrupt, ran on past its
            # lease, beside the copy another worker started.
            left = deadline() - time.monotonic()
            if left <= 0:
                raise StoreUnavailableError("no time left before the lease could expire")
            try:
                async with asyncio.timeout(left):
                    return await self.store.save_checkpoint(instance_id, claim.token, data)
            except TimeoutError as exc:
                raise StoreUnavailableError(f"no answer within {left:.1f} s") from exc

        try:
            # The store's UPDATE has claim_token = token in its WHERE clause: after a lost lease
            # (another worker may have claimed the instance) this attempt's checkpoint is refused.
            saved: bool = await retrying(what, deadline, self.metrics.backend_error)(one_try)
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
        broken = False
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
            pass  # the worker stopped it (run_attempt raises only a stop it asked for)
        except Exception:
            # A fault of the worker's own in ending the attempt (whatever the job raises is its
            # outcome, made in run_attempt). Logged, and left to its lease, which is no longer
            # renewed: the reaper releases the instance once it expires, counting an unexpected
            # retry, as after a crash. (Released at once, a fault that recurs on every attempt
            # would run the job again and again, unbounded.)
            broken = True
            logger.exception(
                "attempt of instance %s (%s) could not be ended; its lease will expire",
                attempt.claim.instance.id,
                key,
                extra={
                    "action": "worker.attempt_error",
                    "instance_id": str(attempt.claim.instance.id),
                    "job_key": key,
                },
            )
        finally:
            # The cancels that reached this task (the drain's, a cancel request's, a lost
            # lease's) were for the job's code, which has stopped: absorbed, so that the writes
            # below run as in any task. Race otherwise: while they still counted, the store took
            # a driver error met by the release (Postgres restarting during a shutdown) for
            # this task's cancel, and the release was not retried.
            _absorb_cancels()
            end = ending(attempt, outcome, broken)
            runaway = attempt.code_running
            if runaway:
                # Hold the worker slot before giving the running one up: never a moment where
                # the pool thread looks free. The job's slot too if, and only if, the outcome
                # recorded below keeps it (the watcher gives it back once that is written).
                self.runaways.hold(attempt, holds_slot=end is Ending.RECORD)
            lease_until = self._forget(attempt)
        if end is Ending.LOST:
            self.metrics.ended(key, AttemptEnd.LEASE_LOST)
        elif end is Ending.ERROR:
            self.metrics.ended(key, AttemptEnd.ERROR)
        elif end is Ending.RELEASE:
            self.metrics.ended(key, AttemptEnd.RELEASED)
            await self.recorder.release(attempt, lease_until)
        elif end is Ending.RECORD:
            assert outcome is not None
            if runaway:
                # Recorded now without giving the job's slot back: its code still runs, and max
                # concurrency counts it until the thread returns.
                outcome = replace(outcome, holds_slot=True)
            try:
                await self.leases.flush_progress(attempt)
            finally:
                # Queued whatever happened above: a runaway's watcher waits for it.
                # The outcome state itself is the label (succeeded, failed, cancelled, or any
                # other an attempt may end in): a label never fails the recording of an outcome.
                self.metrics.ended(key, outcome.state.value)
                self.recorder.put(attempt, outcome)

    # -- events ----------------------------------------------------------------------------

    async def _events_loop(self) -> None:
        """Cancel requests reach the running attempt at once (the heartbeat is the backstop)."""
        await listen(
            self.bus,
            self._on_cancel_requested,
            role="worker",
            what="cancel requests",
            kinds={EventKind.CANCEL_REQUESTED},
            on_bus_error=self.metrics.backend_error,
        )

    async def _on_cancel_requested(self, event: Event) -> None:
        try:
            instance_id = UUID(str(event.data.get("instance_id")))
        except ValueError:
            logger.warning(
                "dropped a cancel request without a valid instance id: %r",
                event.data,
                extra={"action": "worker.events"},
            )
            return
        attempt = self._current.get(instance_id)
        if attempt is not None:
            attempt.ctx.cancellation.set(StopReason.CANCEL_REQUESTED)
        elif event.data.get("worker_id") == self.id:
            # Race: the claim committed (the row names this worker) and its answer is still on
            # its way: the attempt starts cancelled (see _start). Dropped, the job ran until a
            # heartbeat said so, to its end if it was shorter.
            now = time.monotonic()
            self._early_cancels = {
                i: at for i, at in self._early_cancels.items() if now - at < self.settings.lease_s
            }
            self._early_cancels[instance_id] = now

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
            pending: list[asyncio.Task[Any]] = [
                a.task for a in self.running.values() if a.task is not None
            ]
            pending += self.runaways.watchers()
            if not pending:
                return
            threads = sum(a.code_running for a in self.running.values()) + len(self.runaways)
            if threads:
                logger.warning(
                    "shutdown waits on %d job(s) still running code that ignores its "
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


def _absorb_cancels() -> None:
    """Forget the cancels the current task has received (see :meth:`Worker._run`)."""
    task = asyncio.current_task()
    while task is not None and task.cancelling():
        task.uncancel()


def _raise_if_dead(side: list[asyncio.Task[Any]]) -> None:
    """A dead side task (recorder, heartbeat) stops the worker instead of leaving it half alive."""
    for task in side:
        if task.done():
            exc = task.exception() if not task.cancelled() else None
            if isinstance(exc, WorkerEvictedError):
                raise exc  # as it is: the role exits at once on it
            raise RuntimeError(f"{task.get_name()} stopped") from exc
