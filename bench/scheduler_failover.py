"""Leader failover time: two scheduler processes; the leader is killed (SIGKILL) or stopped
(SIGTERM); the clock runs until the store names a new leader.

    .venv/bin/python -m bench.scheduler_failover [--rounds 3] [--ttl 5]

The schedulers log at WARNING; BENCH_LOG_LEVEL=INFO shows their leadership changes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time

from bench.common import REDIS_URL, ROOT, environment, percentile, stop_processes
from jobplane.store.sql import SqlStore


def spawn(url: str, prefix: str, ttl: float) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "JOBPLANE_DATABASE_URL": url,
        "JOBPLANE_REDIS_URL": REDIS_URL,
        "JOBPLANE_KEY_PREFIX": prefix,
        "JOBPLANE_LEASE_TTL_S": str(ttl),
        "JOBPLANE_LOG_LEVEL": os.environ.get("BENCH_LOG_LEVEL", "WARNING"),
    }
    return subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "jobplane"), "scheduler"],
        cwd=ROOT,
        env=env,
    )


async def leader(store: SqlStore) -> tuple[str, int] | None:
    lease = await store.get_leader(0)
    return (lease.holder, lease.term) if lease else None


async def one_round(
    store: SqlStore,
    procs: dict[int, subprocess.Popen[bytes]],
    signalled: list[subprocess.Popen[bytes]],
    sig: signal.Signals,
    url: str,
    prefix: str,
    ttl: float,
) -> float:
    deadline = time.monotonic() + 120
    while (current := await leader(store)) is None:
        if time.monotonic() > deadline:
            raise RuntimeError("no scheduler became leader in 120 s")
        await asyncio.sleep(0.01)
    await asyncio.sleep(ttl)  # a settled leader and a settled follower
    current = await leader(store)
    assert current is not None
    pid = int(current[0].rsplit(":", 1)[1])
    started = time.perf_counter()
    stopped = procs.pop(pid)
    signalled.append(stopped)  # still waited for at the end (killed if a round fails)
    stopped.send_signal(sig)
    while True:
        now = await leader(store)
        if now is not None and now[1] > current[1]:
            elapsed = time.perf_counter() - started
            break
        if time.perf_counter() - started > 120:
            raise RuntimeError(f"no new leader 120 s after {sig.name}")
        await asyncio.sleep(0.005)
    replacement = spawn(url, prefix, ttl)
    procs[replacement.pid] = replacement
    return elapsed


async def main(rounds: int, ttl: float) -> None:
    async with environment() as (url, prefix, store):
        procs = {p.pid: p for p in (spawn(url, prefix, ttl), spawn(url, prefix, ttl))}
        signalled: list[subprocess.Popen[bytes]] = []
        try:
            for sig in (signal.SIGKILL, signal.SIGTERM):
                times = [
                    await one_round(store, procs, signalled, sig, url, prefix, ttl)
                    for _ in range(rounds)
                ]
                print(
                    f"failover on {sig.name} (lease TTL {ttl:g} s, {rounds} rounds): "
                    f"median {percentile(times, 0.5):.3f} s, max {max(times):.3f} s"
                )
        finally:
            stop_processes([*procs.values(), *signalled])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ttl", type=float, default=5.0)
    ns = parser.parse_args()
    asyncio.run(main(ns.rounds, ns.ttl))
