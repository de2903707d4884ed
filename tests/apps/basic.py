"""Jobs used by the worker tests (imported by real worker subprocesses too)."""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import time
from pathlib import Path

from pydantic import BaseModel

from jobplane import App, JobContext
from jobplane.context import LeaseLostError

app = App("tests")


class EchoArgs(BaseModel):
    value: int


@app.triggered(max_concurrency=50)
async def echo(ctx: JobContext, args: EchoArgs) -> dict[str, int | str]:
    return {"value": args.value, "worker": ctx.worker_id}


@app.triggered(max_concurrency=10)
def add_sync(args: EchoArgs) -> int:
    return args.value + 1


@app.triggered(retries=2, backoff={"kind": "none"})
async def always_fails() -> None:
    raise ValueError("no luck")


@app.triggered(timeout_s=0.3)
async def too_slow(ctx: JobContext) -> None:
    await asyncio.sleep(30)


@app.triggered(max_concurrency=5)
async def sleepy(ctx: JobContext) -> str:
    """Sleeps for JOBPLANE_TEST_SLEEP_S seconds (default 0.2); notes its start in a file."""
    marker = os.environ.get("JOBPLANE_TEST_MARKER")
    if marker:
        _note(Path(marker), str(ctx.instance_id))
    await asyncio.sleep(float(os.environ.get("JOBPLANE_TEST_SLEEP_S", "0.2")))
    return "rested"


@app.triggered()
def returns_garbage() -> object:
    return object()


@app.triggered()
def sync_sleeper(ctx: JobContext) -> str:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not ctx.cancelled:
        time.sleep(0.01)
    return "cancelled" if ctx.cancelled else "done"


def _note(path: Path, line: str) -> None:
    with path.open("a") as f:
        f.write(f"{line}\n")


class PidFile(BaseModel):
    path: str


# The timeout of the isolated jobs that run into it. It includes the child's start: about 0.7 s
# on the 2-core machine, but over 2 s while the suite runs in parallel beside other work (with
# 2 s the child was sometimes stopped before it wrote its pid or set its signal handler).
CHILD_TIMEOUT_S = 5.0


@app.triggered(isolation="process", timeout_s=CHILD_TIMEOUT_S)
def runaway(args: PidFile) -> None:
    """Ignores every cancellation; only a kill stops it."""
    Path(args.path).write_text(str(os.getpid()))
    while True:
        time.sleep(0.05)


@app.triggered(isolation="process", max_concurrency=4)
def child_square(args: EchoArgs) -> int:
    return args.value**2


@app.triggered(isolation="process")
def child_fails() -> None:
    raise KeyError("inside the child")


@app.triggered(max_concurrency=100)
async def slow_echo(args: EchoArgs) -> int:
    await asyncio.sleep(0.3)
    return args.value


@app.triggered(isolation="process", retries=1, backoff={"kind": "none"})
def child_resumes(ctx: JobContext) -> dict[str, int]:
    """Reports progress and saves a checkpoint from the child; the first attempt then fails,
    the retry starts from the checkpoint."""
    start = int(ctx.last_checkpoint or 0)
    ctx.progress(0.5, f"from {start}")
    ctx.checkpoint_sync(start + 10)
    if ctx.attempt == 1:
        raise RuntimeError("first attempt fails after its checkpoint")
    return {"resumed_from": start}


@app.triggered(isolation="process", retries=1, backoff={"kind": "none"})
async def child_resumes_async(ctx: JobContext) -> dict[str, int]:
    """:func:`child_resumes` for an async job (``await ctx.checkpoint``)."""
    start = int(ctx.last_checkpoint or 0)
    ctx.progress(0.25, f"from {start}")
    await ctx.checkpoint(start + 5)
    if ctx.attempt == 1:
        raise RuntimeError("first attempt fails after its checkpoint")
    return {"resumed_from": start}


class Gate(BaseModel):
    path: str


@app.triggered(timeout_s=1.0)
def ignores_timeout(ctx: JobContext, args: Gate) -> str:
    """A sync job that ignores its cancellation: it returns only once the file ``path`` exists
    (or after 60 s, so that a failed test leaves no thread behind for long)."""
    _note(Path(args.path + ".started"), str(ctx.instance_id))
    deadline = time.monotonic() + 60
    while not Path(args.path).exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return "returned at last"


@app.triggered(isolation="process", timeout_s=60)
def child_checkpoints_late(ctx: JobContext, args: Gate) -> None:
    """Waits for the file ``path``, then saves a checkpoint; notes in ``path.result`` whether
    the worker refused it (the attempt had lost its claim meanwhile)."""
    _note(Path(args.path + ".started"), str(ctx.instance_id))
    deadline = time.monotonic() + 30
    while not Path(args.path).exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        ctx.checkpoint_sync({"late": True})
    except LeaseLostError:
        _note(Path(args.path + ".result"), "refused")
        raise
    _note(Path(args.path + ".result"), "saved")


def _hold_until_gate(ctx: JobContext, args: Gate) -> str:
    """Note the start in ``path.log``, ignore every cancellation until the file ``path`` exists
    (at most 60 s, so a failed test leaves no thread behind for long), note the end."""
    log = Path(args.path + ".log")
    _note(log, f"start {ctx.attempt} {ctx.worker_id}")
    deadline = time.monotonic() + 60
    while not Path(args.path).exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    _note(log, f"end {ctx.attempt} {ctx.worker_id} cancelled={ctx.cancelled}")
    return ctx.worker_id


@app.triggered(
    timeout_s=1.0, max_concurrency=1, retries=1, backoff={"kind": "none"}, on_limit="wait"
)
def runaway_retried(ctx: JobContext, args: Gate) -> str:
    """The first attempt ignores its 1 s timeout until ``path`` exists; the retry returns."""
    if ctx.attempt > 1:
        _note(Path(args.path + ".log"), f"start {ctx.attempt} {ctx.worker_id}")
        return ctx.worker_id
    return _hold_until_gate(ctx, args)


@app.triggered(max_concurrency=1)
def ignores_shutdown(ctx: JobContext, args: Gate) -> str:
    """Ignores the shutdown's cancellation (its timeout is an hour away) until ``path``
    exists."""
    return _hold_until_gate(ctx, args)


@app.triggered(isolation="process", timeout_s=CHILD_TIMEOUT_S)
def child_notices_timeout(ctx: JobContext, args: Gate) -> str:
    """Polls ``ctx.cancelled`` (set in the child by the worker's signal), notes the reason in
    ``path`` and returns."""
    Path(args.path + ".started").write_text(str(os.getpid()))
    deadline = time.monotonic() + 30
    while not ctx.cancelled and time.monotonic() < deadline:
        time.sleep(0.02)
    Path(args.path).write_text(str(ctx.cancellation.reason))
    return "stopped"


class Packages(BaseModel):
    names: list[str]


@app.triggered()
def loaded_packages(args: Packages) -> list[str]:
    """Which of ``names`` (top-level packages or dotted modules) this process has imported:
    what a worker carries, seen from inside it."""
    return sorted(name for name in args.names if name in sys.modules)


@app.triggered()
def frozen_heap() -> int:
    """How many objects this process froze out of the garbage collector's reach
    (``gc.get_freeze_count()``): a role's process freezes its start-up heap."""
    return gc.get_freeze_count()
