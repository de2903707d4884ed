"""The embedded default as ``jobplane dev`` runs it: a SQLite file, the in-process bus, and a
worker and a scheduler in the benchmark's own process, on the same store as the triggers.

    .venv/bin/python -m bench.embedded [--jobs 5000] [--singles 500] [--concurrency 64]

1. ``Dispatcher.trigger`` one at a time, awaited, ``--singles`` times: triggers/s.
2. ``enqueue_async`` in a transaction of the application's own (one each), ``--singles``
   times: ms a call.
3. ``Dispatcher.trigger_many``, 1,000 a call, up to ``--jobs``: instances/s.
4. A worker (``--concurrency``) and a scheduler start and drain all of it: jobs/s, from their
   start to the last instance Succeeded (the enqueued ones wait for the leader's sweep to
   publish them, as in ``jobplane dev``).

Every instance is written with its history, as on Postgres; no role runs while the backlog is
made, so those figures are the store's alone. Figures are printed, not checked.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from bench.apps import app
from bench.common import CHUNK, trigger_backlog
from jobplane.backends import migrate_database
from jobplane.bus.factory import open_bus
from jobplane.dispatch import Dispatcher
from jobplane.domain.options import JobOptions
from jobplane.domain.states import InstanceState
from jobplane.enqueue import enqueue_async
from jobplane.store.factory import open_store
from jobplane_scheduler.scheduler import Scheduler
from jobplane_scheduler.settings import SchedulerSettings
from jobplane_worker.settings import WorkerSettings
from jobplane_worker.worker import Worker


async def main(jobs: int, singles: int, concurrency: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        url = f"sqlite:///{Path(folder) / 'jobplane.db'}"
        await migrate_database(url)
        store, bus = open_store(url), open_bus("memory://")
        try:
            options = JobOptions.parse(key="noop", kind="triggered", max_concurrency=1_000_000)
            await store.register_definition(options, None, "bench")
            dispatcher = Dispatcher(store, bus)

            started = time.perf_counter()
            for _ in range(singles):
                await dispatcher.trigger("noop")
            took = time.perf_counter() - started
            print(f"trigger, one at a time: {singles / took:,.0f}/s")

            started = time.perf_counter()
            for _ in range(singles):
                async with store.engine.begin() as conn:
                    await enqueue_async(conn, "noop")
            took = time.perf_counter() - started
            print(f"enqueue_async, a transaction each: {took / singles * 1000:.2f} ms a call")

            took = await trigger_backlog(dispatcher, jobs)
            print(f"trigger_many, {CHUNK} a call: {jobs / took:,.0f} instances/s")

            total = jobs + 2 * singles
            stop = asyncio.Event()
            worker_settings = WorkerSettings(
                database_url=url, redis_url="memory://", concurrency=concurrency
            )
            worker = Worker(app, store, bus, worker_settings)
            scheduler = Scheduler(
                store, bus, SchedulerSettings(database_url=url, redis_url="memory://")
            )
            started = time.perf_counter()
            roles = [asyncio.create_task(r.run(stop)) for r in (worker, scheduler)]
            while (await store.count_by_state("noop")).get(InstanceState.SUCCEEDED, 0) < total:
                for role in roles:
                    if role.done():
                        role.result()  # its error
                await asyncio.sleep(0.05)
            took = time.perf_counter() - started
            print(f"drain ({total:,} no-op jobs, one worker in-process): {total / took:,.0f}/s")
            stop.set()
            await asyncio.gather(*roles)
        finally:
            await bus.close()
            await store.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--singles", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=64)
    arguments = parser.parse_args()
    asyncio.run(main(arguments.jobs, arguments.singles, arguments.concurrency))
