"""Jobs used by the worker tests (imported by real worker subprocesses too)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from pydantic import BaseModel

from jobplane import App, JobContext

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


@app.triggered(isolation="process", timeout_s=1.0)
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
