"""Cron fire lag with many one-second schedules: the time from a tick to its instance being
recorded Enqueued (the creation record's clock_timestamp() minus the scheduled time).

    .venv/bin/python -m bench.fire_lag [--jobs 1000] [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys

from sqlalchemy import text

from bench.common import REDIS_URL, ROOT, environment, percentile
from jobplane.domain.options import JobOptions


async def main(jobs: int, seconds: float) -> None:
    async with environment() as (url, prefix, store):
        for i in range(jobs):
            options = JobOptions.parse(key=f"tick-{i:04d}", kind="recurring", cron="* * * * * *")
            await store.register_definition(options, None, "bench")
        env = {
            **os.environ,
            "JOBPLANE_DATABASE_URL": url,
            "JOBPLANE_REDIS_URL": REDIS_URL,
            "JOBPLANE_KEY_PREFIX": prefix,
            "JOBPLANE_LOG_LEVEL": "WARNING",
        }
        scheduler = subprocess.Popen(
            [os.path.join(os.path.dirname(sys.executable), "jobplane"), "scheduler"],
            cwd=ROOT,
            env=env,
        )
        try:
            await asyncio.sleep(seconds + 2)
        finally:
            scheduler.terminate()
            scheduler.wait(timeout=30)
        async with store.engine.connect() as conn:
            rows = (
                (
                    await conn.execute(
                        text(
                            "SELECT extract(epoch FROM t.at - i.scheduled_at) FROM job_instances i"
                            " JOIN instance_transitions t ON t.instance_id = i.id"
                            " AND t.from_state IS NULL WHERE i.source = 'cron'"
                            " AND i.state = 'enqueued' ORDER BY i.scheduled_at"
                        )
                    )
                )
                .scalars()
                .all()
            )
        lags = [float(v) * 1000 for v in rows]
        # The first second includes start-up (loading 1,000 definitions): leave it out.
        steady = lags[jobs:]
        print(
            f"fire lag, {jobs} one-second schedules, {len(steady)} fires: "
            f"p50 {percentile(steady, 0.5):.1f} ms, p99 {percentile(steady, 0.99):.1f} ms, "
            f"max {max(steady):.1f} ms"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=10)
    ns = parser.parse_args()
    asyncio.run(main(ns.jobs, ns.seconds))
