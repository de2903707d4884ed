"""Delay from committing an in-transaction enqueue to its publication on the bus, with a
scheduler process leading (it listens for the commit's NOTIFY; its sweep is the backstop).

    .venv/bin/python -m bench.enqueue_delay [--count 20]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from sqlalchemy import create_engine
from sqlalchemy.engine import make_url

from bench.common import environment, percentile, spawn_scheduler
from jobplane.domain.options import JobOptions
from jobplane.enqueue import enqueue


async def main(count: int) -> None:
    async with environment() as (url, prefix, store):
        await store.register_definition(JobOptions.parse(key="noop", kind="triggered"), None, "b")
        scheduler = spawn_scheduler(url, prefix)
        engine = create_engine(make_url(url).set(drivername="postgresql+psycopg"))
        delays = []
        try:
            await asyncio.sleep(2)
            for _ in range(count):
                with engine.begin() as conn:
                    instance_id = enqueue(conn, "noop")
                committed = time.perf_counter()
                while (await store.get_instance(instance_id)).published_at is None:
                    await asyncio.sleep(0.005)
                delays.append(time.perf_counter() - committed)
                await asyncio.sleep(0.137)  # spread commits over the sweep's phase
        finally:
            engine.dispose()
            scheduler.terminate()
            scheduler.wait(timeout=30)
        print(
            f"in-transaction enqueue → published ({count} commits, NOTIFY to the leader): "
            f"p50 {percentile(delays, 0.5) * 1000:.0f} ms, max {max(delays) * 1000:.0f} ms"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=20)
    asyncio.run(main(parser.parse_args().count))
