"""The job the peers' harness runs on Jobplane, in a module of its own: the two worker
processes import this (``--app bench.peers.adapters.jobplane_jobs:app``), and only what a
Jobplane worker of this job would import, not the harness's clients (httpx, the benchmark
set-up), which would count against the workers' memory and start-up."""

from __future__ import annotations

from pydantic import BaseModel

from bench.peers.adapters import probe
from jobplane import App

app = App("peers")


class Sent(BaseModel):
    t: float = 0.0


@app.triggered(key="noop", max_concurrency=1_000_000)
async def noop(args: Sent) -> None:
    probe.record(args.t)
