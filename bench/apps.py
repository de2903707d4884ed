"""Jobs used by the benchmarks."""

from __future__ import annotations

import asyncio

from pydantic import BaseModel

from jobplane import App

app = App("bench")


@app.triggered(max_concurrency=1_000_000)
async def noop() -> None:
    """Does nothing: the benchmark measures Jobplane, not the job."""


class HoldArgs(BaseModel):
    seconds: float = 600.0


@app.triggered(max_concurrency=1_000_000)
async def hold(args: HoldArgs) -> None:
    """Runs until cancelled or ``seconds`` pass: an attempt for a benchmark to interrupt."""
    await asyncio.sleep(args.seconds)
