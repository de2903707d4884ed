"""No-op jobs per second drained by two worker processes on Postgres + Redis.

    .venv/bin/python -m bench.throughput [--jobs 20000] [--workers 2] [--concurrency 256]

Every instance goes Enqueued → Processing → Succeeded with its history in Postgres. The backlog
is created first (bulk insert + publish, timed separately as trigger throughput), then the
workers start and the clock runs until every instance has Succeeded.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from datetime import datetime

from sqlalchemy import text

from bench.common import bus_for, environment, spawn_worker, wait_until
from jobplane.dispatch import Dispatcher
from jobplane.domain.models import NewInstance
from jobplane.domain.options import JobOptions
from jobplane.domain.states import InstanceState
from jobplane.store.sql import SqlStore

CHUNK = 1000


async def main(jobs: int, workers: int, concurrency: int) -> None:
    async with environment() as (url, prefix, store):
        options = JobOptions.parse(key="noop", kind="triggered", max_concurrency=1_000_000)
        await store.register_definition(options, None, "bench")
        bus = bus_for(prefix)
        dispatcher = Dispatcher(store, bus)
        started = time.perf_counter()
        for offset in range(0, jobs, CHUNK):
            n = min(CHUNK, jobs - offset)
            await dispatcher.trigger_many([NewInstance(job_key="noop") for _ in range(n)])
        created = time.perf_counter() - started
        print(f"trigger (bulk, {CHUNK} per call): {jobs / created:,.0f} instances/s")

        procs = [spawn_worker(url, prefix, i, concurrency) for i in range(workers)]
        started = time.perf_counter()
        try:

            async def drained() -> bool:
                counts = await store.count_by_state("noop")
                return counts.get(InstanceState.SUCCEEDED, 0) >= jobs

            await wait_until(drained)
            elapsed = time.perf_counter() - started
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(timeout=60)
            await bus.close()
        first, last = await _window(store)
        busy = (last - first).total_seconds()
        print(
            f"drain: {jobs} no-op jobs, {workers} worker process(es): {jobs / busy:,.0f} jobs/s "
            f"from first claim to last success ({busy:.2f} s; {jobs / elapsed:,.0f} jobs/s "
            f"counting worker start-up, {elapsed:.2f} s)"
        )


async def _window(store: SqlStore) -> tuple[datetime, datetime]:
    """First claim and last success, from the transition history (the database's clock)."""
    async with store.engine.connect() as conn:
        row = (
            await conn.execute(
                text(
                    "SELECT min(at) FILTER (WHERE to_state = 'processing'),"
                    " max(at) FILTER (WHERE to_state = 'succeeded') FROM instance_transitions"
                )
            )
        ).one()
    return row[0], row[1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=512)
    ns = parser.parse_args()
    asyncio.run(main(ns.jobs, ns.workers, ns.concurrency))
