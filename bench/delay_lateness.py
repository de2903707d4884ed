"""How late a short delay starts: triggers with a delay shorter than the sweep interval, made
at every phase of the sweep, with a scheduler process leading. The lateness of one is its
promotion's history record minus its ``run_at`` (both on the database's clock).

    .venv/bin/python -m bench.delay_lateness [--count 40] [--delay-ms 200]
"""

from __future__ import annotations

import argparse
import asyncio
import random
from datetime import timedelta

from bench.common import bus_for, environment, percentile, spawn_scheduler
from jobplane.dispatch import Dispatcher
from jobplane.domain.options import JobOptions
from jobplane.domain.states import InstanceState


async def main(count: int, delay_ms: int) -> None:
    async with environment() as (url, prefix, store):
        await store.register_definition(JobOptions.parse(key="noop", kind="triggered"), None, "b")
        scheduler = spawn_scheduler(url, prefix)
        bus = bus_for(prefix)
        dispatcher = Dispatcher(store, bus)
        late, phases = [], random.Random(7)
        try:
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
        finally:
            await bus.close()
            scheduler.terminate()
            scheduler.wait(timeout=30)
        print(
            f"trigger with a {delay_ms} ms delay → promoted ({count} triggers, sweeps 1 s "
            f"apart): late by p50 {percentile(late, 0.5) * 1000:.1f} ms, "
            f"p99 {percentile(late, 0.99) * 1000:.1f} ms, max {max(late) * 1000:.1f} ms"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=40)
    parser.add_argument("--delay-ms", type=int, default=200)
    arguments = parser.parse_args()
    asyncio.run(main(arguments.count, arguments.delay_ms))
