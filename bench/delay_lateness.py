"""How late a short delay starts: triggers with a delay shorter than the sweep interval, made
at every phase of the sweep, with a scheduler leading. The lateness of one is its promotion's
history record minus its ``run_at`` (both on the store's clock).

    .venv/bin/python -m bench.delay_lateness [--count 40] [--delay-ms 200] [--embedded]

By default a ``jobplane scheduler`` process leads on Postgres and Redis. With ``--embedded``,
the embedded default as ``jobplane dev`` runs it: a SQLite file, the in-process bus, and the
scheduler in this process, on the same store as the triggers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import tempfile
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

from bench.common import bus_for, environment, percentile, spawn_scheduler
from jobplane.backends import migrate_database
from jobplane.bus.abc import Bus
from jobplane.bus.factory import open_bus
from jobplane.dispatch import Dispatcher
from jobplane.domain.options import JobOptions
from jobplane.domain.states import InstanceState
from jobplane.store.factory import open_store
from jobplane.store.sql import SqlStore
from jobplane_scheduler.scheduler import Scheduler
from jobplane_scheduler.settings import SchedulerSettings


@contextlib.asynccontextmanager
async def on_postgres() -> AsyncIterator[tuple[SqlStore, Bus]]:
    """A fresh database and key prefix, a scheduler process leading on them."""
    async with environment() as (url, prefix, store):
        scheduler = spawn_scheduler(url, prefix)
        bus = bus_for(prefix)
        try:
            yield store, bus
        finally:
            await bus.close()
            scheduler.terminate()
            scheduler.wait(timeout=30)


@contextlib.asynccontextmanager
async def embedded() -> AsyncIterator[tuple[SqlStore, Bus]]:
    """A fresh SQLite file and the in-process bus, a scheduler leading in this process."""
    with tempfile.TemporaryDirectory() as folder:
        url = f"sqlite:///{Path(folder) / 'jobplane.db'}"
        await migrate_database(url)
        store, bus, stop = open_store(url), open_bus("memory://"), asyncio.Event()
        settings = SchedulerSettings(database_url=url, redis_url="memory://")
        leading = asyncio.create_task(Scheduler(store, bus, settings).run(stop))
        try:
            yield store, bus
        finally:
            stop.set()
            await leading
            await bus.close()
            await store.close()


async def main(count: int, delay_ms: int, in_process: bool) -> None:
    async with embedded() if in_process else on_postgres() as (store, bus):
        await store.register_definition(JobOptions.parse(key="noop", kind="triggered"), None, "b")
        dispatcher = Dispatcher(store, bus)
        late, phases = [], random.Random(7)
        await asyncio.sleep(2)
        for _ in range(count):
            made = await dispatcher.trigger("noop", delay=timedelta(milliseconds=delay_ms))
            assert made.run_at is not None
            while (await store.get_instance(made.id)).state is InstanceState.SCHEDULED:
                await asyncio.sleep(0.005)
            promoted = (await store.transitions(made.id))[-1]
            late.append((promoted.at - made.run_at).total_seconds())
            # Each promotion came at some phase of the sweep: start the next one anywhere.
            await asyncio.sleep(phases.uniform(0.0, 1.0))
    where = "SQLite, in-process bus and scheduler" if in_process else "Postgres and Redis"
    print(
        f"trigger with a {delay_ms} ms delay → promoted ({count} triggers, {where}, sweeps "
        f"1 s apart): late by p50 {percentile(late, 0.5) * 1000:.1f} ms, "
        f"p99 {percentile(late, 0.99) * 1000:.1f} ms, max {max(late) * 1000:.1f} ms"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=40)
    parser.add_argument("--delay-ms", type=int, default=200)
    parser.add_argument("--embedded", action="store_true", help="SQLite, as jobplane dev runs")
    arguments = parser.parse_args()
    asyncio.run(main(arguments.count, arguments.delay_ms, arguments.embedded))
