"""Isolated jobs (``isolation="process"``) whose child, or what it started, could outlive its
attempt or hold up the worker (imported by worker processes too)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
import time
from pathlib import Path

from pydantic import BaseModel

from jobplane import App, JobContext

app = App("isolated")


class Gate(BaseModel):
    path: str


def _note(path: str, text: str) -> None:
    Path(path).write_text(text)


@app.triggered(isolation="process", timeout_s=120)
def ticks_until_killed(ctx: JobContext, args: Gate) -> None:
    """Notes its pid in ``path.pid``, then works for up to 40 s without a word to the worker."""
    _note(f"{args.path}.pid", str(os.getpid()))
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        time.sleep(0.1)


@app.triggered(isolation="process", timeout_s=4.0)
def shells_out(args: Gate) -> None:
    """Runs a long command (as an isolated job that wraps a tool does) and waits for it."""
    proc = subprocess.Popen(["sleep", "45"])
    _note(f"{args.path}.command", str(proc.pid))
    proc.wait()


@app.triggered(isolation="process", timeout_s=60)
async def finishes_in_two_seconds(args: Gate) -> str:
    """An async isolated job that ends well within a worker's drain grace."""
    await asyncio.to_thread(_note, f"{args.path}.started", str(os.getpid()))
    await asyncio.sleep(2.0)
    return "finished"


@app.triggered(isolation="process", timeout_s=60, max_concurrency=4)
def leaves_a_thread(args: Gate) -> str:
    """Returns at once, leaving a (non-daemon) thread behind: the child's interpreter waits for
    it on exit, as it does for a ThreadPoolExecutor's threads."""
    threading.Thread(target=time.sleep, args=(8,)).start()
    return "returned"


@app.triggered(isolation="process", timeout_s=120)
async def raises_when_stopped(ctx: JobContext, args: Gate) -> None:
    """Notes its pid, then waits for its stop and fails on it (as a job whose call was
    interrupted does)."""
    await asyncio.to_thread(_note, f"{args.path}.pid", str(os.getpid()))
    await ctx.cancellation.wait()
    raise RuntimeError("interrupted by the stop")


@app.triggered(isolation="process", timeout_s=120)
async def returns_when_stopped(ctx: JobContext, args: Gate) -> dict[str, bool]:
    """Notes its pid, then waits for its stop and returns early, a partial result (as a job
    that checks ``ctx.cancelled`` between its steps does)."""
    await asyncio.to_thread(_note, f"{args.path}.pid", str(os.getpid()))
    await ctx.cancellation.wait()
    return {"partial": True}
