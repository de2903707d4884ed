"""Jobs used by the benchmarks."""

from __future__ import annotations

from jobplane import App

app = App("bench")


@app.triggered(max_concurrency=1_000_000)
async def noop() -> None:
    """Does nothing: the benchmark measures Jobplane, not the job."""
