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

The worker applies progress and checkpoints to the attempt's own :class:`JobContext`, so they go
through the same fenced writes as in-process jobs: progress with the next heartbeat, a checkpoint
at once with the claim token in its WHERE clause. ``ctx.checkpoint`` and ``ctx.checkpoint_sync``
in the child return once the worker has stored the data (or raise ``LeaseLostError``), and the
child starts with the instance's last checkpoint, so a retry resumes where the last one stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import multiprocessing
import os
import signal
import threading
from datetime import datetime
from multiprocessing.connection import Connection
from typing import Any
from uuid import UUID

from pydantic import BaseModel

from jobplane.app import App, JobSpec
from jobplane.context import JobContext, LeaseLostError, bind_worker
from jobplane.domain.limits import MAX_RESULT_BYTES, check_json
from jobplane.domain.reasons import StopReason
from jobplane.errors import JobplaneError, StoreUnavailableError
from jobplane_worker.job_errors import exception_message, exception_traceback

logger = logging.getLogger(__name__)

KILL_GRACE_S = 1.0
Message = dict[str, Any]


class ChildFailedError(JobplaneError):
    """The job raised in the child process; carries the child's exception type and traceback."""

    def __init__(self, type_name: str, message: str, child_traceback: str) -> None:
        super().__init__(message)
        self.type_name = type_name
        self.child_traceback = child_traceback


# -- the worker's side ---------------------------------------------------------------------


async def run_in_child(
    spec: JobSpec, ctx: JobContext, args: Any, timeout_s: float, grace_s: float
) -> Any:
    """Run one attempt in a child process.

    Stopping it has two phases, as for in-process jobs: at the timeout, or when the attempt's
    cancellation is signalled (cancel request, shutdown, lost lease), the child gets SIGTERM,
    which sets ``ctx.cancellation`` inside it; if it has not ended ``grace_s`` later it gets
    SIGKILL. Raises TimeoutError after a timeout (even if the child returned within the grace)
    and ``asyncio.CancelledError`` after a cancellation — in both cases only once the child is
    gone."""
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
    process = mp.Process(
        target=_child_main,
        args=(spec.func.__module__, spec.key, args, info, child_events, child_replies),
        name=f"jobplane-job-{ctx.instance_id}",
        daemon=True,
    )
    process.start()
    child_events.close()
    child_replies.close()
    link = _WorkerLink(ctx, replies)
    final = link.start_reader(events)
    cancelled: asyncio.Future[Any] = asyncio.ensure_future(ctx.cancellation.wait())
    try:
        done, _ = await asyncio.wait(
            {final, cancelled}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        if final in done:
            # Off the loop: a child's exit may wait for threads its job left running.
            await asyncio.get_running_loop().run_in_executor(None, process.join, KILL_GRACE_S)
            return _unpack(final.result(), process)
        if cancelled not in done:
            ctx.cancellation.set(StopReason.TIMEOUT)
        await _stop(process, final, grace_s, ctx)
        if ctx.cancellation.reason == StopReason.TIMEOUT:
            raise TimeoutError  # whether or not it returned within the grace
        raise asyncio.CancelledError
    finally:
        cancelled.cancel()
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


# -- the child's side ----------------------------------------------------------------------


class _ChildLink:
    """The child's end of the pipes. Thread-safe: a job may report from threads of its own."""

    def __init__(self, events: Connection, replies: Connection) -> None:
        self._events = events
        self._replies = replies
        self._sending = threading.Lock()
        self._checkpointing = threading.Lock()  # one request at a time: its answer comes next

    def send(self, message: Message) -> None:
        data = json.dumps(message).encode()
        with self._sending:
            self._events.send_bytes(data)

    def progress(self, fraction: float, message: str | None) -> None:
        self.send({"kind": "progress", "fraction": fraction, "message": message})

    def checkpoint(self, data: Any) -> bool:
        """Ask the worker to store ``data``; True once stored, False if the attempt was fenced
        off. Blocks until the worker answers."""
        with self._checkpointing:
            self.send({"kind": "checkpoint", "data": data})
            try:
                reply: Message = json.loads(self._replies.recv_bytes())
            except (EOFError, OSError) as exc:
                raise StoreUnavailableError("the worker stopped answering") from exc
        if reply["error"] is not None:
            raise StoreUnavailableError(reply["error"])
        return bool(reply["saved"])

    async def checkpoint_async(self, data: Any) -> bool:
        return await asyncio.to_thread(self.checkpoint, data)


#: A SIGTERM received before the job's context existed (in the child process only).
_early_signal = threading.Event()


def _child_main(
    module_name: str,
    key: str,
    args: Any,
    info: dict[str, Any],
    events: Connection,
    replies: Connection,
) -> None:
    # A process group of its own: a terminal's Ctrl-C (the worker's graceful stop) or a
    # supervisor's signal to the worker's group reaches the worker alone, which stops the
    # child in its two phases (it failed the job at once: KeyboardInterrupt); and the worker
    # kills what the job started with it.
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_die_with_the_worker, name="jobplane-watch", daemon=True).start()
    # Until the job's context exists, a SIGTERM is only noted (the default would kill the
    # child before it can answer); _child_run turns it into the job's cancellation.
    signal.signal(signal.SIGTERM, lambda _signum, _frame: _early_signal.set())
    link = _ChildLink(events, replies)
    try:
        result = asyncio.run(_child_run(module_name, key, args, info, link))
        message = _ok_message(result)
    except BaseException as exc:
        message = _error_message(exc)
    try:
        link.send(message)
    finally:
        events.close()
        replies.close()


def _die_with_the_worker() -> None:
    """End this child and its group when the worker process is gone (SIGKILL, the OOM
    killer): nobody can record the attempt, and the reaper hands the instance to another
    worker once the lease ends, so a child that ran on was a second copy beside the next."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return  # (not a child: nothing to watch)
    multiprocessing.connection.wait([parent.sentinel])
    os.killpg(0, signal.SIGKILL)


def _ok_message(result: Any) -> Message:
    if isinstance(result, BaseModel):
        result = result.model_dump(mode="json")
    try:
        # Nothing stored that cannot be read back: depth, NaN and NUL checked as for args.
        check_json(result, "result", max_bytes=MAX_RESULT_BYTES)
    except (TypeError, ValueError) as exc:
        return _error_message(TypeError(f"job result is not JSON serialisable: {exc}"))
    return {"kind": "ok", "result": result}


def _error_message(exc: BaseException) -> Message:
    # The job's exception: its __str__ may raise (the child would then die without an answer).
    return {
        "kind": "error",
        "type": type(exc).__name__,
        "message": exception_message(exc),
        "traceback": exception_traceback(exc),
    }


async def _child_run(
    module_name: str, key: str, args: Any, info: dict[str, Any], link: _ChildLink
) -> Any:
    app = _find_app(importlib.import_module(module_name), key)
    spec = app.jobs[key]
    scheduled_at = info["scheduled_at"]
    ctx = bind_worker(
        JobContext(
            instance_id=UUID(info["instance_id"]),
            job_key=info["job_key"],
            attempt=info["attempt"],
            scheduled_at=datetime.fromisoformat(scheduled_at) if scheduled_at else None,
            worker_id=info["worker_id"],
            last_checkpoint=json.loads(info["last_checkpoint"]),
        ),
        saver=link.checkpoint_async,
        sync_saver=link.checkpoint,
        on_progress=link.progress,
    )
    # The worker's SIGTERM (timeout, cancel request, shutdown) sets the job's cancellation, on
    # this loop; the worker sends SIGKILL if the job has not ended within its grace.
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, ctx.cancellation.set, StopReason.SIGNALLED)
    if _early_signal.is_set():
        ctx.cancellation.set(StopReason.SIGNALLED)
    async with app.lifespan() as resources:
        kwargs = spec.bind(ctx, args, resources)
        if spec.is_async:
            return await spec.func(**kwargs)
        # In a thread of its own, so that this loop stays free to handle the signal.
        return await asyncio.to_thread(spec.func, **kwargs)


def _find_app(module: Any, key: str) -> App:
    for value in vars(module).values():
        if isinstance(value, App) and key in value.jobs:
            return value
    raise LookupError(f"no App in {module.__name__} declares job {key!r}")
