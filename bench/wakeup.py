"""What one round trip to Postgres and to Redis costs back to back, and paced: the same call
made again at once, and made after the caller (and so the server) slept between calls, as
at a steady low rate. The difference is the cost of waking sleeping processes on this machine,
which every hop of the trigger → start path pays at a low rate (the trigger's statement, its
answer, the publish, the worker's wake-up, the claim).

    .venv/bin/python -m bench.wakeup [--calls 300] [--pause-ms 10]

Postgres, on an asyncpg connection to ``JOBPLANE_TEST_POSTGRES_URL``: ``SELECT 1`` (nothing
written), and a one-row ``INSERT`` in autocommit (its commit waits for the WAL flush: the
floor of any durable write, such as a trigger's). Redis: ``PING`` through redis-py. p50 and
p90 of each call, after 20 unmeasured ones. Figures are printed, not checked.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable

import asyncpg
import redis.asyncio as aioredis

from bench.api import print_table
from bench.common import POSTGRES_URL, REDIS_URL, percentile

WARM_UP = 20
#: A table of the benchmark's own (dropped at the end): a logged one, so a commit waits for
#: its WAL flush, as every write of Jobplane does.
TABLE = "jobplane_bench_wakeup"
INSERT = f"INSERT INTO {TABLE} VALUES (1)"


async def _timed(call: Callable[[], Awaitable[object]], calls: int, pause_s: float) -> list[float]:
    """Each call's time (ms), ``pause_s`` asleep before each."""
    times: list[float] = []
    for n in range(calls + WARM_UP):
        if pause_s:
            await asyncio.sleep(pause_s)
        began = time.perf_counter()
        await call()
        if n >= WARM_UP:
            times.append((time.perf_counter() - began) * 1000)
    return times


async def main(calls: int, pause_ms: float, dsn: str) -> None:
    pg = await asyncpg.connect(dsn)
    client = aioredis.from_url(REDIS_URL)
    rows: list[tuple[str, ...]] = []
    try:
        await pg.execute(f"CREATE TABLE IF NOT EXISTS {TABLE} (v integer)")
        targets: list[tuple[str, Callable[[], Awaitable[object]]]] = [
            ("Postgres SELECT 1", lambda: pg.fetchval("SELECT 1")),
            ("Postgres one-row INSERT, committed", lambda: pg.execute(INSERT)),
            ("Redis PING", client.ping),
        ]
        for name, call in targets:
            for pause_s, how in (
                (0.0, "back to back"),
                (pause_ms / 1000, f"{pause_ms:g} ms apart"),
            ):
                times = await _timed(call, calls, pause_s)
                rows.append(
                    (
                        name,
                        how,
                        f"{percentile(times, 0.50):.3f}",
                        f"{percentile(times, 0.90):.3f}",
                    )
                )
    finally:
        await pg.execute(f"DROP TABLE IF EXISTS {TABLE}")
        await pg.close()
        await client.aclose()
    print_table("One round trip", ("call", "made", "p50 ms", "p90 ms"), rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=300, help="measured calls per row")
    parser.add_argument("--pause-ms", type=float, default=10.0, help="sleep between paced calls")
    ns = parser.parse_args()
    asyncio.run(main(ns.calls, ns.pause_ms, POSTGRES_URL))
