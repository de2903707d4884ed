"""``isolation="process"``: run an attempt in a child process that can really be killed.

A thread cannot be stopped, so a sync job that ignores its timeout keeps its slot until its code
returns. In a child process the worker can enforce the timeout and a cancel: SIGTERM, then
SIGKILL after a short grace, and only then is the outcome recorded and the slot given back.

The child is started with the ``spawn`` method: it imports the job's module, finds the App that
declares the job, runs the app's startup hooks for resources, runs the job once and sends back
its result or error over a pipe. Progress and checkpoints are not available in the child.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import multiprocessing
import traceback
from multiprocessing.connection import Connection
from typing import Any
from uuid import UUID

from jobplane.app import App, JobSpec
from jobplane.context import JobContext

logger = logging.getLogger(__name__)

KILL_GRACE_S = 1.0


class ChildFailedError(Exception):
    """The job raised in the child process; carries the child's exception type and traceback."""

    def __init__(self, type_name: str, message: str, child_traceback: str) -> None:
        super().__init__(message)
        self.type_name = type_name
        self.child_traceback = child_traceback


async def run_in_child(spec: JobSpec, ctx: JobContext, args: Any, timeout_s: float) -> Any:
    """Run one attempt in a child process. Raises TimeoutError after ``timeout_s`` and
    ``asyncio.CancelledError`` when the attempt's cancellation is signalled — in both cases
    only once the child is dead."""
    mp = multiprocessing.get_context("spawn")
    receiver, sender = mp.Pipe(duplex=False)
    info = (str(ctx.instance_id), ctx.job_key, ctx.attempt, ctx.worker_id)
    process = mp.Process(
        target=_child_main,
        args=(spec.func.__module__, spec.key, args, info, sender),
        name=f"jobplane-job-{ctx.instance_id}",
        daemon=True,
    )
    process.start()
    sender.close()
    loop = asyncio.get_running_loop()
    reply: asyncio.Future[tuple[str, Any] | None] = loop.run_in_executor(None, _receive, receiver)
    cancelled: asyncio.Future[Any] = asyncio.ensure_future(ctx.cancellation.wait())
    try:
        waiting: set[asyncio.Future[Any]] = {reply, cancelled}
        done, _ = await asyncio.wait(
            waiting, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        if reply in done:
            return _unpack(reply.result(), process)
        await _kill(process)
        if cancelled in done:
            raise asyncio.CancelledError
        ctx.cancellation.set("timeout")
        raise TimeoutError
    finally:
        cancelled.cancel()
        if process.is_alive():
            await _kill(process)
        receiver.close()
        await asyncio.gather(reply, return_exceptions=True)


def _receive(receiver: Connection) -> tuple[str, Any] | None:
    try:
        return receiver.recv()  # type: ignore[no-any-return]
    except (EOFError, OSError):
        return None  # the child died without answering


def _unpack(message: tuple[str, Any] | None, process: Any) -> Any:
    process.join(KILL_GRACE_S)
    if message is None:
        raise RuntimeError(f"job process exited with code {process.exitcode} without a result")
    kind, payload = message
    if kind == "ok":
        return payload
    type_name, text, child_traceback = payload
    raise ChildFailedError(type_name, text, child_traceback)


async def _kill(process: Any) -> None:
    """SIGTERM, a short grace, then SIGKILL; returns once the process is gone."""
    process.terminate()
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, process.join, KILL_GRACE_S)
    if process.is_alive():
        process.kill()
        await loop.run_in_executor(None, process.join)
    logger.info(
        "killed job process %s (exit code %s)",
        process.pid,
        process.exitcode,
        extra={"action": "worker.child_killed"},
    )


def _child_main(
    module_name: str, key: str, args: Any, info: tuple[str, str, int, str], sender: Connection
) -> None:
    try:
        result = asyncio.run(_child_run(module_name, key, args, info))
        sender.send(("ok", result))
    except BaseException as exc:
        text = "".join(traceback.format_exception(exc))
        sender.send(("error", (type(exc).__name__, str(exc), text)))
    finally:
        sender.close()


async def _child_run(module_name: str, key: str, args: Any, info: tuple[str, str, int, str]) -> Any:
    app = _find_app(importlib.import_module(module_name), key)
    spec = app.jobs[key]
    instance_id, job_key, attempt, worker_id = info
    ctx = JobContext(
        instance_id=UUID(instance_id),
        job_key=job_key,
        attempt=attempt,
        scheduled_at=None,
        worker_id=worker_id,
    )
    async with app.lifespan() as resources:
        kwargs = spec.bind(ctx, args, resources)
        if spec.is_async:
            return await spec.func(**kwargs)
        return spec.func(**kwargs)


def _find_app(module: Any, key: str) -> App:
    for value in vars(module).values():
        if isinstance(value, App) and key in value.jobs:
            return value
    raise LookupError(f"no App in {module.__name__} declares job {key!r}")
