"""A worker's start: from starting a ``jobplane worker`` process to its registration in
Postgres (its row in ``workers``, written once its imports, settings, App, connections and
schema check are done and it is about to consume).

    .venv/bin/python -m bench.startup [--starts 20] [--command PATH ...]

Each ``--command`` is a ``jobplane`` executable (default: this environment's); with several,
their starts alternate (one of each, then again), so that a before/after comparison shares
the machine's moods. Each start gets a worker id of its own, is polled for every 2 ms, then
stopped with SIGTERM. Figures are printed, not checked.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from sqlalchemy import text

from bench.common import REDIS_URL, ROOT, environment
from jobplane.store.sql import SqlStore

#: How long one start may take before the benchmark gives up on it.
START_TIMEOUT_S = 60.0


async def _registered(store: SqlStore, worker_id: str) -> bool:
    async with store.engine.connect() as conn:
        found = await conn.execute(text("SELECT 1 FROM workers WHERE id = :id"), {"id": worker_id})
        return found.first() is not None


async def start_once(command: str, env: dict[str, str], store: SqlStore) -> float:
    """Seconds from starting ``command worker`` to the worker's registration."""
    worker_id = f"bench-start-{uuid.uuid4().hex[:8]}"
    argv = [command, "worker", "--app", "bench.apps:app", "--worker-id", worker_id]
    started = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    try:
        while not await _registered(store, worker_id):
            if proc.poll() is not None or time.perf_counter() - started > START_TIMEOUT_S:
                raise RuntimeError(f"{command} worker did not register (exit {proc.returncode})")
            await asyncio.sleep(0.002)
        return time.perf_counter() - started
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.wait, 60)


async def main(commands: list[str], starts: int) -> None:
    async with environment() as (url, prefix, store):
        env = {
            **os.environ,
            "JOBPLANE_DATABASE_URL": url,
            "JOBPLANE_REDIS_URL": REDIS_URL,
            "JOBPLANE_KEY_PREFIX": prefix,
            "JOBPLANE_LOG_LEVEL": "WARNING",
        }
        times: dict[str, list[float]] = {c: [] for c in commands}
        for _ in range(starts):
            for command in commands:
                times[command].append(await start_once(command, env, store))
    print(f"\nA worker's start to its registration ({starts} starts each, in turns)")
    print(f"{'command':<40} {'median ms':>10} {'min ms':>8} {'max ms':>8}")
    for command, values in times.items():
        ms = [v * 1000 for v in values]
        print(f"{command:<40} {statistics.median(ms):>10.0f} {min(ms):>8.0f} {max(ms):>8.0f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=20, help="Starts of each command.")
    parser.add_argument(
        "--command",
        action="append",
        help="A jobplane executable (repeat to compare; default: this environment's).",
    )
    ns = parser.parse_args()
    default = str(Path(sys.executable).parent / "jobplane")
    asyncio.run(main(ns.command or [default], ns.starts))
