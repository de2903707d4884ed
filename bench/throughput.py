"""No-op jobs per second drained by two worker processes on Postgres + Redis.

    .venv/bin/python -m bench.throughput [--jobs 20000] [--workers 2] [--concurrency 512]
                                         [--history 0]

Every instance goes Enqueued → Processing → Succeeded with its history in Postgres. The backlog
is created first (bulk insert + publish, timed separately as trigger throughput), then the
workers start and the clock runs until every instance has Succeeded. Then it prints the CPU
per job of the workers and of their Postgres backends.

With ``--history N`` the table first holds N finished instances (created, then set Succeeded in
one UPDATE, without their history records), vacuumed and analyzed, as a database in service
is: its statistics then say that Enqueued and Processing rows are rare, and the backlog arrives
after them, as a burst does.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from datetime import datetime

from sqlalchemy import text

from bench.common import (
    CHUNK,
    bus_for,
    cpu_seconds,
    environment,
    spawn_worker,
    trigger_backlog,
    wait_until,
)
from jobplane.dispatch import Dispatcher
from jobplane.domain.models import NewInstance
from jobplane.domain.options import JobOptions
from jobplane.domain.states import InstanceState
from jobplane.store.sql import SqlStore


async def main(jobs: int, workers: int, concurrency: int, history: int) -> None:
    async with environment() as (url, prefix, store):
        options = JobOptions.parse(key="noop", kind="triggered", max_concurrency=1_000_000)
        await store.register_definition(options, None, "bench")
        if history:
            await _history(store, history)
        bus = bus_for(prefix)
        dispatcher = Dispatcher(store, bus)
        created = await trigger_backlog(dispatcher, jobs)
        print(f"trigger (bulk, {CHUNK} per call): {jobs / created:,.0f} instances/s")

        spawned = await store.now()  # the workers' backends start after this
        procs = [spawn_worker(url, prefix, i, concurrency) for i in range(workers)]
        started = time.perf_counter()
        try:

            async def drained() -> bool:
                counts = await store.count_by_state("noop")
                return counts.get(InstanceState.SUCCEEDED, 0) >= jobs + history

            await wait_until(drained)
            elapsed = time.perf_counter() - started
            # CPU per job, read before the processes stop: the workers' (their start-up
            # included, about 0.6 s each) and their Postgres backends'.
            worker_cpu = cpu_seconds(proc.pid for proc in procs)
            backend_cpu = cpu_seconds(await _backends(store, spawned))
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
        print(
            f"  CPU per job: workers {worker_cpu / jobs * 1000:.3f} ms, their Postgres backends "
            f"{backend_cpu / jobs * 1000:.3f} ms"
        )


async def _history(store: SqlStore, count: int) -> None:
    for offset in range(0, count, 5 * CHUNK):
        n = min(5 * CHUNK, count - offset)
        await store.create_instances([NewInstance(job_key="noop") for _ in range(n)])
    async with store.engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE job_instances SET state = 'succeeded', attempt = 1,"
                " started_at = now(), finished_at = now()"
            )
        )
    async with store.engine.connect() as conn:
        await conn.execution_options(isolation_level="AUTOCOMMIT")
        await conn.execute(text("VACUUM ANALYZE job_instances"))
    print(f"history: {count} finished instances, analyzed")


async def _backends(store: SqlStore, since: datetime) -> list[int]:
    """The pids of the sessions on this benchmark's database opened since ``since`` (the
    workers'; the benchmark's own, which created the backlog, were opened before)."""
    async with store.engine.connect() as conn:
        found = await conn.execute(
            text(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                " AND backend_start >= :since AND pid <> pg_backend_pid()"
            ),
            {"since": since},
        )
        return [row[0] for row in found]


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
    parser.add_argument(
        "--history", type=int, default=0, help="finished instances in the table before the backlog"
    )
    ns = parser.parse_args()
    asyncio.run(main(ns.jobs, ns.workers, ns.concurrency, ns.history))
