"""Every kind of job, for the fault-injection harness (``tests/chaos``), run by real worker
processes. Each job is short, so that the harness's quiet period drains them all."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from pydantic import BaseModel

from jobplane import App, JobContext

app = App("chaos")


class Args(BaseModel):
    value: int


#: File (set by the harness) where the longer jobs note when each attempt's code ran.
RUNS_ENV = "JOBPLANE_CHAOS_RUNS"


@contextmanager
def recorded(ctx: JobContext) -> Iterator[None]:
    """Note the start and the end of this attempt's code (wall clock, one line each, appended
    in one write), so the checker can see two copies of one instance running at once."""
    path = os.environ.get(RUNS_ENV)
    if not path:
        yield
        return
    who = f"{ctx.instance_id} {ctx.attempt} {ctx.worker_id} {ctx.job_key}"
    _append(path, f"start {who} {time.time():.3f}\n")
    try:
        yield
    finally:
        _append(path, f"end {who} {time.time():.3f}\n")


def _append(path: str, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


@app.triggered(max_concurrency=50)
async def fast(args: Args) -> int:
    return args.value


@app.triggered(max_concurrency=20)
async def slow_async(ctx: JobContext, args: Args) -> int:
    with recorded(ctx):
        await asyncio.sleep(1.5)
    return args.value


@app.triggered(max_concurrency=10)
def sync_work(ctx: JobContext, args: Args) -> int:
    with recorded(ctx):
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline and not ctx.cancelled:
            time.sleep(0.02)
    return args.value


#: Seconds the runaway job runs, and its timeout: past it (and the worker's timeout grace, 0.3 s
#: in the harness) it is recorded Failed while its code runs on, holding its slot (a runaway).
RUNAWAY_RUNS_S = 1.5
RUNAWAY_TIMEOUT_S = 0.5


#: Jobs whose code cannot be stopped: a copy of theirs may run on after its lease is lost.
UNSTOPPABLE = frozenset({"runaway"})


@app.triggered(max_concurrency=2, timeout_s=RUNAWAY_TIMEOUT_S)
def runaway(ctx: JobContext, args: Args) -> int:
    """A sync job that ignores its timeout and the cancellation signal."""
    with recorded(ctx):
        time.sleep(RUNAWAY_RUNS_S)
    return args.value


@app.triggered(retries=3, backoff={"kind": "none"})
async def flaky(ctx: JobContext, args: Args) -> int:
    """Fails its first attempt, succeeds on a retry."""
    if ctx.attempt == 1:
        raise RuntimeError("first attempt fails")
    return args.value


@app.triggered(max_concurrency=2, on_limit="skip")
async def limited_skip(args: Args) -> int:
    await asyncio.sleep(0.5)
    return args.value


@app.triggered(max_concurrency=3, on_limit="wait")
async def limited_wait(args: Args) -> int:
    await asyncio.sleep(0.5)
    return args.value


@app.triggered(retries=1, backoff={"kind": "none"})
async def checkpointing(ctx: JobContext, args: Args) -> dict[str, int]:
    """Saves a checkpoint per step; a later attempt resumes from the last one saved."""
    start = int(ctx.last_checkpoint or 0)
    with recorded(ctx):
        for step in range(start, 4):
            await asyncio.sleep(0.2)
            await ctx.checkpoint(step + 1)
    return {"resumed_from": start, "value": args.value}


@app.triggered(isolation="process", max_concurrency=2, timeout_s=30)
def isolated(args: Args) -> int:
    return args.value * 2


@app.triggered(max_concurrency=20)
async def pinned(ctx: JobContext, args: Args) -> str:
    """Triggered with a ``pinned_worker``; returns who ran it."""
    return ctx.worker_id


async def tick(ctx: JobContext) -> str | None:
    return ctx.scheduled_at.isoformat() if ctx.scheduled_at else None


#: Recurring job key → misfire policy. Their ticks are checked for gaps and duplicates.
TICKS = {"tick_once": "fire_once", "tick_all": "fire_all", "tick_skip": "skip"}
#: A recurring job the load pauses and resumes (checked for duplicate ticks only).
PAUSED_TICK = "tick_paused"

for _key, _policy in TICKS.items():
    app.recurring("* * * * * *", key=_key, max_concurrency=10, misfire=_policy)(tick)
app.recurring("* * * * * *", key=PAUSED_TICK, max_concurrency=10)(tick)
