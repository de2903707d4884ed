"""What a running job sees of its attempt: ids, attempt number, a bound logger, cancellation."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from uuid import UUID

from jobplane.domain.limits import MAX_RESULT_BYTES, check_json, check_text
from jobplane.domain.reasons import StopReason
from jobplane.errors import CheckpointNotSavedError as CheckpointNotSavedError  # re-exported
from jobplane.errors import LeaseLostError as LeaseLostError  # re-exported

logger = logging.getLogger(__name__)


class Cancellation:
    """A cancellation signal usable from async code (``await wait()``, or a callback that
    cancels the job's task) and from sync code in a pool thread (``is_set``,
    ``wait_sync(timeout)``). Set by the worker, on the event loop. Cheap to create: the
    primitives behind it are made only when someone waits."""

    def __init__(self) -> None:
        self._set = False
        self._thread_event: threading.Event | None = None
        self._async_event: asyncio.Event | None = None
        self._callbacks: list[Callable[[], object]] = []
        #: Why the signal was set first (a :class:`~jobplane.domain.reasons.StopReason`).
        self.reason: StopReason | None = None
        #: Whether a cancel was requested, even if another reason set the signal first (a
        #: cancel arriving during a timeout's grace still makes the attempt end Cancelled).
        self.cancel_requested = False

    def set(self, reason: StopReason) -> None:
        """Signal the attempt to stop. The first reason is kept in :attr:`reason` and the
        callbacks run once; a later cancel request is still recorded (:attr:`cancel_requested`)."""
        if reason is StopReason.CANCEL_REQUESTED:
            self.cancel_requested = True
        if self._set:
            return
        self.reason = reason
        self._set = True  # a plain bool: reads from pool threads are safe under the GIL
        if self._thread_event is not None:
            self._thread_event.set()
        if self._async_event is not None:
            self._async_event.set()
        for callback in self._callbacks:
            _call(callback)

    def on_set(self, callback: Callable[[], object]) -> None:
        """Call ``callback`` (on the event loop) when the signal is set. What it raises is
        logged, not raised: the signal is set by the worker's own loops (heartbeat, fence,
        drain, cancel events), which a job's callback must not end."""
        if self._set:
            _call(callback)
        else:
            self._callbacks.append(callback)

    def is_set(self) -> bool:
        return self._set

    async def wait(self) -> str | None:
        if self._async_event is None:
            self._async_event = asyncio.Event()
            if self._set:
                self._async_event.set()
        await self._async_event.wait()
        return self.reason

    def wait_sync(self, timeout: float | None = None) -> bool:
        if self._thread_event is None:
            self._thread_event = threading.Event()
            if self._set:
                self._thread_event.set()
        return self._thread_event.wait(timeout)


def _call(callback: Callable[[], object]) -> None:
    """Run a cancellation callback; what it raises is logged (see :meth:`Cancellation.on_set`)."""
    try:
        callback()
    except Exception:
        logger.exception(
            "a cancellation callback raised; the signal is set all the same",
            extra={"action": "worker.cancellation_callback"},
        )


class _InstanceLogger(logging.LoggerAdapter[logging.Logger]):
    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        extra = dict(self.extra or {})
        extra.update(kwargs.get("extra") or {})
        kwargs["extra"] = extra
        return f"[{extra['job_key']} {extra['instance_id']}] {msg}", kwargs


#: Progress messages longer than this are refused.
PROGRESS_MESSAGE_MAX = 1000


@dataclass(frozen=True, slots=True)
class _WorkerHooks:
    """How a context reaches its worker; empty outside one."""

    #: Persists a checkpoint, fenced by the claim token.
    saver: Callable[[Any], Awaitable[bool]] | None = None
    #: In an isolated job's child process: :meth:`JobContext.checkpoint_sync` calls it directly
    #: (the job runs on the child's only thread, so it cannot hand the write to an event loop).
    sync_saver: Callable[[Any], bool] | None = None
    #: In an isolated job's child process: forwards each progress report to the worker.
    on_progress: Callable[[float, str | None], None] | None = None
    #: The worker's event loop, on which a sync job's checkpoint is written.
    loop: asyncio.AbstractEventLoop | None = None


@dataclass
class JobContext:
    """Handed to a job function that asks for it (a parameter annotated ``JobContext``)."""

    instance_id: UUID
    job_key: str
    attempt: int
    #: When the instance was due: the occurrence's time for a cron fire, else its ``run_at``
    #: (a delayed trigger, or the due time of a retry), else its creation time (an immediate
    #: trigger). ``None`` only in a child process (``isolation="process"``).
    scheduled_at: datetime | None
    worker_id: str
    #: The checkpoint saved by an earlier attempt of this instance (``None`` on the first).
    last_checkpoint: Any = None
    #: Set by the worker when the attempt should stop; ``await ctx.cancellation.wait()`` (async)
    #: or ``ctx.cancellation.wait_sync(timeout)`` (a sync job's thread) waits for it.
    cancellation: Cancellation = field(default_factory=Cancellation)
    logger: logging.LoggerAdapter[logging.Logger] = field(init=False)
    # The worker's plumbing, not the job's: set with :func:`bind_worker`, read with
    # :func:`pending_progress`.
    _hooks: _WorkerHooks = field(init=False, repr=False)
    _pending_progress: tuple[float, str | None] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._hooks = _WorkerHooks()
        self.logger = _InstanceLogger(
            logging.getLogger(f"jobplane.jobs.{self.job_key}"),
            {
                "instance_id": str(self.instance_id),
                "job_key": self.job_key,
                "attempt": self.attempt,
                "worker_id": self.worker_id,
            },
        )

    @property
    def cancelled(self) -> bool:
        """True once the attempt should stop (cancel requested, timeout, shutdown, lease lost)."""
        return self.cancellation.is_set()

    def progress(self, fraction: float, message: str | None = None) -> None:
        """Report how far the job is (0 to 1). Cheap, from sync or async code: the latest value
        is written with the attempt's next heartbeat."""
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"progress fraction must be within [0, 1], got {fraction}")
        if message is not None:
            # Refused here, in the job, rather than by the database in the heartbeat's write.
            check_text(message, "progress message", max_length=PROGRESS_MESSAGE_MAX)
        self._pending_progress = (fraction, message)
        if self._hooks.on_progress is not None:
            self._hooks.on_progress(fraction, message)

    async def checkpoint(self, data: Any) -> None:
        """Persist ``data`` (JSON) now; the next attempt of this instance gets it back as
        :attr:`last_checkpoint`. While the store is unreachable the write is retried with
        backoff as long as this attempt's lease may still hold, then
        :class:`CheckpointNotSavedError` is raised. Raises :class:`LeaseLostError` if this
        attempt was fenced (not retried). Data that could not be read back (see
        :func:`~jobplane.domain.limits.check_json`) raises InvalidOptionsError."""
        check_json(data, "checkpoint", max_bytes=MAX_RESULT_BYTES)
        if self._hooks.saver is None:
            raise RuntimeError("checkpoint() is only available inside a worker")
        if not await self._hooks.saver(data):
            raise LeaseLostError(f"instance {self.instance_id}: checkpoint refused, lease lost")
        self.last_checkpoint = data

    def checkpoint_sync(self, data: Any) -> None:
        """:meth:`checkpoint` for sync jobs (they run in a pool thread, or in a child process
        with ``isolation="process"``)."""
        check_json(data, "checkpoint", max_bytes=MAX_RESULT_BYTES)
        sync_saver = self._hooks.sync_saver
        if sync_saver is not None:
            if not sync_saver(data):
                raise LeaseLostError(f"instance {self.instance_id}: checkpoint refused, lease lost")
            self.last_checkpoint = data
            return
        if self._hooks.loop is None:
            raise RuntimeError("checkpoint_sync() is only available inside a worker")
        if _running_loop() is self._hooks.loop:
            # Called on the loop's own thread (from an async job): waiting here for the loop
            # to save it froze the loop, and with it the whole worker, for good.
            raise RuntimeError(
                "checkpoint_sync() blocks: from an async job, use `await ctx.checkpoint(...)`"
            )
        asyncio.run_coroutine_threadsafe(self.checkpoint(data), self._hooks.loop).result()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running in this thread, if any."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


# -- the worker's side (not for job code) ---------------------------------------------------


def bind_worker(
    ctx: JobContext,
    *,
    saver: Callable[[Any], Awaitable[bool]] | None = None,
    sync_saver: Callable[[Any], bool] | None = None,
    on_progress: Callable[[float, str | None], None] | None = None,
    loop: asyncio.AbstractEventLoop | None = None,
) -> JobContext:
    """Connect ``ctx`` to the worker running its attempt (see :class:`_WorkerHooks`)."""
    ctx._hooks = _WorkerHooks(saver, sync_saver, on_progress, loop)
    return ctx


def pending_progress(ctx: JobContext) -> tuple[float, str | None] | None:
    """The latest progress reported and not yet written (the next heartbeat sends it)."""
    return ctx._pending_progress


def progress_written(ctx: JobContext, progress: tuple[float, str | None]) -> None:
    """``progress`` (as :func:`pending_progress` returned it) was written: clear it, unless a
    newer report came in meanwhile (a new tuple, even with the same values)."""
    if ctx._pending_progress is progress:
        ctx._pending_progress = None
