"""Cron fire lag with many one-second schedules: the time from a tick to its instances being
recorded Enqueued, as anyone can first see them.

    .venv/bin/python -m bench.fire_lag [--jobs 1000] [--seconds 10]

"visible" is, per tick, when the commit of its instances reached this benchmark (a statement
trigger the benchmark adds to its database notifies a channel it listens on; Postgres delivers
a notification at the commit) minus the tick. "recorded" is each creation record's time minus
the tick: a tick written ahead of its time and committed at it records the tick itself, so
only "visible" measures it. "bus" is each message's Redis stream entry time (millisecond
precision) minus the tick: the publish, as a worker could first read it. For a tick fired at
its time, "begin" is the fire's transaction start (``created_at``, the database's ``now()``)
minus the tick (the wake-up and what the leader did before its write) and "insert" the
creation record minus that start (the write itself). The clocks are the machine's one clock.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import asyncpg
import redis.asyncio as aioredis
from sqlalchemy import make_url, text

from bench.common import REDIS_URL, environment, percentile, spawn_scheduler
from jobplane.bus.envelope import Envelope
from jobplane.domain.options import JobOptions


async def _bus_times(prefix: str) -> dict[UUID, float]:
    """Each published instance's stream entry time (epoch seconds, from the entry id)."""
    client: Any = aioredis.from_url(REDIS_URL)
    times: dict[UUID, float] = {}
    try:
        async for key in client.scan_iter(match=f"{prefix}:q:*", count=1000):
            start = b"-"
            while True:
                page = await client.xrange(key, min=start, max=b"+", count=5000)
                for entry_id, fields in page:
                    envelope = Envelope.decode(fields[b"d"])
                    times.setdefault(envelope.instance_id, int(entry_id.split(b"-")[0]) / 1000)
                if len(page) < 5000:
                    break
                start = b"(" + page[-1][0]
    finally:
        await client.aclose()
    return times


def _summary(name: str, values: list[float]) -> str:
    return (
        f"{name} p50 {percentile(values, 0.5):.1f} ms, p99 {percentile(values, 0.99):.1f} ms, "
        f"max {max(values):.1f} ms"
    )


#: Ticks after the leader's first write that are left out as its start-up.
STARTUP_TICKS = 3

#: Notifies, at the commit of each statement that inserted cron instances, their earliest
#: tick (epoch seconds) and how many there were.
_NOTIFY_FIRES = [
    """CREATE FUNCTION bench_fired() RETURNS trigger LANGUAGE plpgsql AS $$
    DECLARE
        tick double precision;
        n bigint;
    BEGIN
        SELECT extract(epoch FROM min(scheduled_at)), count(*) INTO tick, n
        FROM new_rows WHERE source = 'cron';
        IF n > 0 THEN
            PERFORM pg_notify('bench_fired', tick || ' ' || n);
        END IF;
        RETURN NULL;
    END $$""",
    """CREATE TRIGGER bench_fired AFTER INSERT ON job_instances
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION bench_fired()""",
]


async def main(jobs: int, seconds: float) -> None:
    async with environment() as (url, prefix, store):
        for i in range(jobs):
            options = JobOptions.parse(key=f"tick-{i:04d}", kind="recurring", cron="* * * * * *")
            await store.register_definition(options, None, "bench")
        async with store.engine.begin() as conn:
            for statement in _NOTIFY_FIRES:
                await conn.execute(text(statement))
        # tick (epoch seconds) → when its last notification came (epoch seconds), and count
        seen: dict[float, tuple[float, int]] = {}

        def notified(_conn: object, _pid: int, _channel: str, payload: str) -> None:
            now = time.time()
            tick, n = payload.split()
            before = seen.get(float(tick), (0.0, 0))
            seen[float(tick)] = (now, before[1] + int(n))

        dsn = make_url(url).set(drivername="postgresql").render_as_string(False)
        listener = await asyncpg.connect(dsn)
        await listener.add_listener("bench_fired", notified)
        scheduler = spawn_scheduler(url, prefix)
        try:
            await asyncio.sleep(seconds + 2)
        finally:
            # Ticks from here on are fired by a leader stopping: left out. (The wait runs off
            # the event loop, which goes on taking the notifications meanwhile: blocked in it,
            # the loop once took the last tick, recorded on time, 108.5 ms late, the run's p99.)
            stopping = time.time()
            scheduler.terminate()
            await asyncio.to_thread(scheduler.wait, 30)
            await listener.close()
        async with store.engine.connect() as conn:
            rows = (
                await conn.execute(
                    text(
                        "SELECT i.id, i.scheduled_at, extract(epoch FROM t.at - i.scheduled_at),"
                        " extract(epoch FROM i.created_at - i.scheduled_at),"
                        " extract(epoch FROM t.at - i.created_at)"
                        " FROM job_instances i"
                        " JOIN instance_transitions t ON t.instance_id = i.id"
                        " AND t.from_state IS NULL WHERE i.source = 'cron'"
                        " AND i.state = 'enqueued' ORDER BY i.scheduled_at, t.at"
                    )
                )
            ).all()
        bus = await _bus_times(prefix)
        # Start-up is left out: the ticks due before the leader's first write (the jobs were
        # registered before the scheduler started, so its first pass fires those late, as a
        # leader catches up any tick due while none ran) and the first STARTUP_TICKS after it
        # (its first sweeps read and plan every job while they are due).
        first_write = min(r[1] + timedelta(seconds=float(r[3])) for r in rows)
        ticks_after = sorted({r[1] for r in rows if r[1] > first_write})
        skipped = ticks_after[STARTUP_TICKS - 1] if len(ticks_after) >= STARTUP_TICKS else None
        steady = [
            r
            for r in rows
            if skipped is not None and r[1] > skipped and r[1].timestamp() < stopping
        ]
        lags = [float(r[2]) * 1000 for r in steady]
        ticks: dict[datetime, list[float]] = {}
        inserts: dict[datetime, float] = {}
        for r in steady:
            ticks.setdefault(r[1], []).append(float(r[3]) * 1000)
            inserts[r[1]] = max(inserts.get(r[1], 0.0), float(r[4]) * 1000)
        begins = [min(v) for v in ticks.values()]
        published = [(bus[r[0]] - r[1].timestamp()) * 1000 for r in steady if r[0] in bus]
        visible = [
            (seen[tick.timestamp()][0] - tick.timestamp()) * 1000
            for tick in ticks
            if tick.timestamp() in seen
        ]
        notified_n = sum(seen[t.timestamp()][1] for t in ticks if t.timestamp() in seen)
        print(f"fire lag, {jobs} one-second schedules, {len(steady)} fires, {len(ticks)} ticks:")
        if visible:
            print(f"  {_summary('visible', visible)} ({notified_n} instances notified)")
        print(f"  {_summary('recorded', lags)}")
        if published:
            print(f"  {_summary('bus', published)} ({len(published)} published)")
        if max(inserts.values(), default=0.0) > 0:  # (a tick written ahead has neither)
            print(f"  per tick: {_summary('begin', begins)};")
            print(f"    {_summary('insert', list(inserts.values()))}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=10)
    ns = parser.parse_args()
    asyncio.run(main(ns.jobs, ns.seconds))
