"""``isolation="process"``: run an attempt in a child process that can really be killed.

A thread cannot be stopped, so a sync job that ignores its timeout keeps its slot until its code
returns. In a child process the worker can enforce the timeout and a cancel, in two phases: at
the timeout (or on a cancel request, a shutdown, a lost lease) the child gets SIGTERM, which sets
``ctx.cancellation`` inside it (``ctx.cancelled`` becomes true; reason "cancelled by the
worker"); if it has not ended ``timeout_grace_s`` later it gets SIGKILL. Only once the child is
gone is the outcome recorded and the slot given back. A timed-out child that returns within the
grace still ends Failed (reason "timeout"), as an async job does. In the child a sync job runs in
a thread, so that the child's event loop is free to handle the signal.

The child is started with the ``spawn`` method: it imports the job's module, finds the App that
declares the job, runs the app's startup hooks for resources and runs the job once. It talks to
the worker over two pipes of JSON messages (never pickle):

- child → worker: ``progress`` reports, ``checkpoint`` requests, and last the ``ok`` result or
  the ``error``;
- worker → child: the answer to each checkpoint request (saved, refused, or failed).

A child also keeps to its attempt's lease by itself. The worker shares with it, in memory it
rewrites as the heartbeat renews the lease, when its fence would stop the attempt and when the
lease surely holds until. Past the first (and a little slack) the child stops itself as at a
SIGTERM; by the second it kills its group. A live worker always acts first; this is for a
worker that cannot: frozen (``SIGSTOP`` to its pid alone), or its event loop blocked.

The worker applies progress and checkpoints to the attempt's own :class:`JobContext`, so they go
through the same fenced writes as in-process jobs: progress with the next heartbeat, a checkpoint
at once with the claim token in its WHERE clause. ``ctx.checkpoint`` and ``ctx.checkpoint_sync``
in the child return once the worker has stored the data (or raise ``LeaseLostError``), and the
child starts with the instance's last checkpoint, so a retry resumes where the last one stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from jobplane.app import JobSpec
from jobplane.context import JobContext, LeaseLostError
from jobplane.domain.reasons import StopReason
from jobplane.errors import JobplaneError
from jobplane_worker.isolation_child import (
    DEADLINES_REFRESH_S,
    KILL,
    STOP,
    STOPPED,
    Message,
    child_main,
)

logger = logging.getLogger(__name__)

KILL_GRACE_S = 1.0

#: (when the worker's fence stops the attempt, when its lease surely holds until), both
#: ``time.monotonic()`` (one clock for every process of the machine); ``None``: not known.
LeaseWindow = Callable[[], "tuple[float, float] | None"]
#: A child stops itself this long after its worker's fence would have stopped it: more than
#: the fence loop's period (at most 0.5 s), so that a live worker always acts first.
SELF_STOP_SLACK_S = 0.6
#: A child kills its group this long before its lease may end.
SELF_KILL_LEAD_S = 0.1


class ChildFailedError(JobplaneError):
    """The job raised in the child process; carries the child's exception type and traceback."""

    def __init__(self, type_name: str, message: str, child_traceback: str) -> None:
        super().__init__(message)
        self.type_name = type_name
        self.child_traceback = child_traceback


# -- the worker's side ---------------------------------------------------------------------


class _Deadlines:
    """The worker's side of what its child keeps to: when to stop itself and when to kill its
    group (see :func:`_keep_to_the_lease`), and whether it stopped itself. Shared memory
    without a lock: a worker frozen while it held one would freeze its child's watch too."""

    def __init__(self, mp: Any, window: LeaseWindow | None) -> None:
        self.values = mp.RawArray("d", [math.inf, math.inf, 0.0])
        self._window = window
        self.refresh()

    def refresh(self) -> None:
        window = self._window() if self._window is not None else None
        if window is None:
            return  # (no longer tracked: the attempt is ending; the last ones stand)
        fence_at, until = window
        kill = until - SELF_KILL_LEAD_S
        # Both only move later: the kill first, so that a child reading between the two
        # writes sees the later kill with the earlier stop, never a kill before its stop.
        self.values[KILL] = kill
        self.values[STOP] = min(fence_at + SELF_STOP_SLACK_S, kill)

    @property
    def stopped_itself(self) -> bool:
        return bool(self.values[STOPPED])

    async def keep_fresh(self) -> None:
        """Rewrite them while the attempt runs: each renewal of the lease moves them on. On
        this event loop, so that a worker whose loop is frozen or blocked stops moving them."""
        while True:
            await asyncio.sleep(DEADLINES_REFRESH_S)
            self.refresh()


async def run_in_child(
    spec: JobSpec,
    ctx: JobContext,
    args: Any,
    timeout_s: float,
    grace_s: float,
    lease_window: LeaseWindow | None = None,
) -> Any:
    """Run one attempt in a child process.

    Stopping it has two phases, as for in-process jobs: at the timeout, or when the attempt's
    cancellation is signalled (cancel request, shutdown, lost lease), the child gets SIGTERM,
    which sets ``ctx.cancellation`` inside it; if it has not ended ``grace_s`` later it gets
    SIGKILL. Raises TimeoutError after a timeout (even if the child returned within the grace)
    and ``asyncio.CancelledError`` after a cancellation — in both cases only once the child is
    gone.

    ``lease_window`` tells the child when to stop by itself, for a worker that cannot stop
    it; an attempt whose child did is released as the fence releases one (CancelledError)."""
    mp = multiprocessing.get_context("spawn")
    events, child_events = mp.Pipe(duplex=False)  # child → worker
    child_replies, replies = mp.Pipe(duplex=False)  # worker → child
    info = {
        "instance_id": str(ctx.instance_id),
        "job_key": ctx.job_key,
        "attempt": ctx.attempt,
        "worker_id": ctx.worker_id,
        "scheduled_at": ctx.scheduled_at.isoformat() if ctx.scheduled_at else None,
        "last_checkpoint": json.dumps(ctx.last_checkpoint),
    }
    deadlines = _Deadlines(mp, lease_window)
    shared = deadlines.values
    process = mp.Process(
        target=child_main,
        args=(spec.func.__module__, spec.key, args, info, child_events, child_replies, shared),
        name=f"jobplane-job-{ctx.instance_id}",
        daemon=True,
    )
    process.start()
    child_events.close()
    child_replies.close()
    link = _WorkerLink(ctx, replies)
    final = link.start_reader(events)
    cancelled: asyncio.Future[Any] = asyncio.ensure_future(ctx.cancellation.wait())
    refresh = asyncio.create_task(deadlines.keep_fresh())
    try:
        done, _ = await asyncio.wait(
            {final, cancelled}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        if final in done:
            # Off the loop: a child's exit may wait for threads its job left running.
            await asyncio.get_running_loop().run_in_executor(None, process.join, KILL_GRACE_S)
            message = final.result()
            if deadlines.stopped_itself:
                # Stopped at the fence, by itself: the lease was not renewed in time (this
                # worker was frozen, or its loop blocked). Released, as the fence releases an
                # attempt, not recorded: what its job returned (a partial result, early),
                # raised, or its death, was the stop's doing. (A result that came just before
                # the stop cannot be told apart: it runs again, as after the worker's fence.)
                ctx.cancellation.set(StopReason.LEASE_LOST)
                raise asyncio.CancelledError
            return _unpack(message, process)
        if cancelled not in done:
            ctx.cancellation.set(StopReason.TIMEOUT)
        await _stop(process, final, grace_s, ctx)
        if ctx.cancellation.reason == StopReason.TIMEOUT:
            raise TimeoutError  # whether or not it returned within the grace
        raise asyncio.CancelledError
    finally:
        cancelled.cancel()
        refresh.cancel()
        if process.is_alive():
            await _kill(process)  # this task itself was cancelled
        _kill_group(process)  # what the job started (its commands) ends with its attempt
        # The child is gone, so the reader sees the end of the pipe and stops. (Bounded: a
        # grandchild that inherited the pipe could keep it open.)
        await asyncio.wait({final}, timeout=KILL_GRACE_S)
        await link.close()
        events.close()
        logger.info(
            "job process %s exited with code %s",
            process.pid,
            process.exitcode,
            extra={
                "action": "worker.child_exited",
                "instance_id": str(ctx.instance_id),
                "job_key": ctx.job_key,
            },
        )


async def _stop(
    process: Any, final: asyncio.Future[Message | None], grace_s: float, ctx: JobContext
) -> None:
    """Signal the child (SIGTERM sets its ``ctx.cancellation``), give it ``grace_s`` to end,
    then SIGKILL it; returns once it is gone."""
    process.terminate()
    await asyncio.wait({final}, timeout=grace_s)  # a cooperative job ends by now
    loop = asyncio.get_running_loop()
    if final.done():
        # It answered: let it exit on its own (it only closes its pipes now).
        await loop.run_in_executor(None, process.join, KILL_GRACE_S)
    if process.is_alive():
        logger.warning(
            "isolated job %s (%s) ignored its cancellation (%s) for %g s; killing it",
            ctx.job_key,
            ctx.instance_id,
            ctx.cancellation.reason,
            grace_s,
            extra={
                "action": "worker.child_kill",
                "instance_id": str(ctx.instance_id),
                "job_key": ctx.job_key,
            },
        )
        _kill_group(process)
        await loop.run_in_executor(None, process.join)


def _kill_group(process: Any) -> None:
    """SIGKILL the child's process group (it leads one, see :func:`_child_main`): the child
    and whatever its job started. A command a job ran (the usual use of isolation) outlived
    the attempt's timeout or cancel, beside the next attempt."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    if process.exitcode is None:
        process.kill()  # (not yet in a group of its own: still starting)


class _WorkerLink:
    """The worker's end of the pipes for one child: a reader thread hands each message to the
    event loop, where progress and checkpoints are applied to the attempt's context."""

    def __init__(self, ctx: JobContext, replies: Connection) -> None:
        self._ctx = ctx
        self._replies = replies
        self._loop = asyncio.get_running_loop()
        self._saving: set[asyncio.Task[None]] = set()

    def start_reader(self, events: Connection) -> asyncio.Future[Message | None]:
        """Start reading ``events``; the future resolves to the child's last message (``ok``
        or ``error``), or ``None`` when the child died without one."""
        final: asyncio.Future[Message | None] = self._loop.create_future()
        # A thread of its own, not the loop's default executor: a child may run for hours and
        # must not hold one of that executor's few threads.
        threading.Thread(
            target=self._read,
            args=(events, final),
            name=f"jobplane-child-{self._ctx.instance_id}",
            daemon=True,
        ).start()
        return final

    def _read(self, events: Connection, final: asyncio.Future[Message | None]) -> None:
        last: Message | None = None
        try:
            while True:
                message: Message = json.loads(events.recv_bytes())
                if message["kind"] in ("ok", "error"):
                    last = message
                    break
                self._loop.call_soon_threadsafe(self._apply, message)
        except (EOFError, OSError):
            pass  # the child died without answering
        except ValueError:
            logger.exception("undecodable message from a job process")
        self._loop.call_soon_threadsafe(_resolve, final, last)

    def _apply(self, message: Message) -> None:
        if message["kind"] == "progress":
            self._ctx.progress(message["fraction"], message["message"])
        elif message["kind"] == "checkpoint":
            task = asyncio.create_task(self._save(message["data"]))
            self._saving.add(task)
            task.add_done_callback(self._saving.discard)

    async def _save(self, data: Any) -> None:
        """Store the child's checkpoint through the attempt's own fenced saver, and answer."""
        reply: Message = {"saved": True, "error": None}
        try:
            await self._ctx.checkpoint(data)
        except LeaseLostError:
            reply["saved"] = False
        except JobplaneError as exc:
            reply = {"saved": False, "error": str(exc)}
        with contextlib.suppress(OSError):  # the child is gone (killed): nobody waits
            self._replies.send_bytes(json.dumps(reply).encode())

    async def close(self) -> None:
        for task in self._saving:
            task.cancel()
        await asyncio.gather(*self._saving, return_exceptions=True)
        self._replies.close()


def _resolve(future: asyncio.Future[Message | None], value: Message | None) -> None:
    if not future.done():
        future.set_result(value)


def _unpack(message: Message | None, process: Any) -> Any:
    if message is None:
        raise RuntimeError(f"job process exited with code {process.exitcode} without a result")
    if message["kind"] == "ok":
        return message["result"]
    raise ChildFailedError(message["type"], message["message"], message["traceback"])


async def _kill(process: Any) -> None:
    """SIGTERM, a short grace, then SIGKILL; returns once the process is gone. For a task
    cancelled from outside (the two phases of :func:`_stop` are the normal path)."""
    process.terminate()
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, process.join, KILL_GRACE_S)
    if process.is_alive():
        _kill_group(process)
        await loop.run_in_executor(None, process.join)
    logger.info(
        "killed job process %s (exit code %s)",
        process.pid,
        process.exitcode,
        extra={"action": "worker.child_killed"},
    )
