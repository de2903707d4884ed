"""One worker's CPU per job at a steady, low rate: the regime most workers live in, where each
job is a batch of its own (its own read, claim, acknowledgement and outcome statement).

    .venv/bin/python -m bench.steady_rate [--rate 50] [--seconds 25] [--idle 10]

One ``jobplane worker`` process (``bench.apps:app``) on a fresh Postgres database and Redis key
prefix. Once it has run a first job, it is left idle ``--idle`` seconds (its CPU then is the
idle cost: heartbeats, the blocking read's wake-ups), then ``Dispatcher.trigger`` is called
``--rate`` times a second, each call at its slot, for ``--seconds``; when every job has
succeeded the worker's CPU (user + system, ``/proc``) over the run is divided by the jobs. The
database's transactions per job (``pg_stat_database``, the triggers' included) are printed
too. Figures are printed, not checked; on a machine whose speed moves, compare runs made in
turns.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from sqlalchemy import text

from bench.common import bus_for, cpu_seconds, environment, spawn_worker, wait_until
from bench.trigger import KEY, _count_workers, _define
from jobplane.dispatch import Dispatcher
from jobplane.domain.states import InstanceState
from jobplane.store.sql import SqlStore

#: pg_stat_database is updated by each backend at most every 500 ms (and when it goes idle).
STATS_SETTLE_S = 1.0


async def _transactions(store: SqlStore) -> int:
    await asyncio.sleep(STATS_SETTLE_S)
    async with store.engine.connect() as conn:
        found = await conn.execute(
            text(
                "SELECT xact_commit + xact_rollback FROM pg_stat_database"
                " WHERE datname = current_database()"
            )
        )
        return int(found.scalar_one())


async def _succeeded(store: SqlStore, n: int) -> bool:
    return (await store.count_by_state(KEY)).get(InstanceState.SUCCEEDED, 0) >= n


async def run(rate: float, seconds: float, idle_s: float) -> None:
    async with environment() as (url, prefix, store):
        await _define(store)
        bus = bus_for(prefix)
        proc = spawn_worker(url, prefix, 0, 64)
        try:
            async with Dispatcher(store, bus) as dispatcher:
                await wait_until(lambda: _count_workers(store, 1), 60)
                await dispatcher.trigger(KEY)
                await wait_until(lambda: _succeeded(store, 1), 60)
                began_cpu, began = cpu_seconds([proc.pid]), time.perf_counter()
                await asyncio.sleep(idle_s)
                idle = (cpu_seconds([proc.pid]) - began_cpu) / (time.perf_counter() - began)
                count = int(rate * seconds)
                transactions = await _transactions(store)
                began_cpu, began = cpu_seconds([proc.pid]), time.perf_counter()
                for n in range(count):
                    pause = began + n / rate - time.perf_counter()
                    if pause > 0:
                        await asyncio.sleep(pause)
                    await dispatcher.trigger(KEY)
                await wait_until(lambda: _succeeded(store, count + 1), 120)
                cpu = cpu_seconds([proc.pid]) - began_cpu
                transactions = await _transactions(store) - transactions
        finally:
            proc.terminate()
            proc.wait(timeout=60)
            await bus.close()
    print(f"worker idle: {idle * 100:.2f} % of a core")
    print(f"worker at {rate:g} jobs/s, {count} jobs: {cpu / count * 1000:.2f} ms of CPU per job")
    print(f"database transactions per job (the trigger's included): {transactions / count:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=50.0, help="triggers/s")
    parser.add_argument("--seconds", type=float, default=25.0, help="how long to trigger")
    parser.add_argument("--idle", type=float, default=10.0, help="idle seconds measured first")
    ns = parser.parse_args()
    asyncio.run(run(ns.rate, ns.seconds, ns.idle))


if __name__ == "__main__":
    main()
