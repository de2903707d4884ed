"""The child process of an ``isolation="process"`` attempt (see :mod:`jobplane_worker.isolation`,
the worker's side): it imports the job's module, finds the App that declares the job, runs the
app's startup hooks and the job once, and answers over its pipes. It also keeps to its
attempt's lease by itself, for a worker that cannot stop it (:func:`_keep_to_the_lease`)."""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from datetime import datetime
from multiprocessing.connection import Connection
from typing import Any
from uuid import UUID

from pydantic import BaseModel

from jobplane.app import App
from jobplane.context import JobContext, bind_worker
from jobplane.domain.limits import MAX_RESULT_BYTES, check_json
from jobplane.domain.reasons import StopReason
from jobplane.errors import StoreUnavailableError
from jobplane_worker.job_errors import exception_message, exception_traceback

logger = logging.getLogger("jobplane_worker.isolation")

Message = dict[str, Any]

#: How often the worker rewrites its child's deadlines, and the child reads them at least.
DEADLINES_REFRESH_S = 0.1
#: The shared deadlines' slots: stop (monotonic), kill (monotonic), stopped itself (0 or 1).
STOP, KILL, STOPPED = 0, 1, 2


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


def child_main(
    module_name: str,
    key: str,
    args: Any,
    info: dict[str, Any],
    events: Connection,
    replies: Connection,
    deadlines: Any,
) -> None:
    # A process group of its own: a terminal's Ctrl-C (the worker's graceful stop) or a
    # supervisor's signal to the worker's group reaches the worker alone, which stops the
    # child in its two phases (it failed the job at once: KeyboardInterrupt); and the worker
    # kills what the job started with it.
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_die_with_the_worker, name="jobplane-watch", daemon=True).start()
    threading.Thread(
        target=_keep_to_the_lease, args=(deadlines,), name="jobplane-lease", daemon=True
    ).start()
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


def _keep_to_the_lease(deadlines: Any) -> None:
    """Stop this child by its lease when its worker cannot: frozen (``SIGSTOP`` to its pid
    alone, a debugger) or its event loop blocked, it neither renews the lease nor runs its
    fence, and the reaper hands the instance to another worker once the lease ends. A child
    that ran on was a second copy beside the next attempt. Past the stop time (the worker's
    fence time and some slack) the child signals itself as the worker would (SIGTERM: the
    job's cancellation); by the kill time, just before the lease may end, it kills its group."""
    stopped = False
    while True:
        now = time.monotonic()
        stop, kill = deadlines[STOP], deadlines[KILL]
        if now >= kill:
            deadlines[STOPPED] = 1.0
            os.killpg(0, signal.SIGKILL)
        if now >= stop and not stopped:
            stopped = True
            deadlines[STOPPED] = 1.0
            logger.warning("the worker did not renew this job's lease in time: stopping it")
            os.kill(os.getpid(), signal.SIGTERM)
        due = kill if stopped else stop
        time.sleep(min(max(due - now, 0.0), DEADLINES_REFRESH_S))


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
