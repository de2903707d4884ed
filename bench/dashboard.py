"""The dashboard's pages on a large table: server time of each page at 1,000,000 instances.

    .venv/bin/python -m bench.dashboard [--instances 1000000] [--requests 20]

A real ``jobplane api`` process (authentication off, as ``jobplane dev``) serves a fresh
Postgres database filled in SQL with ``--instances`` rows (bench/instance_data.py: 20 jobs over
30 days, the newest 0.5 % still running or waiting). Each page, and each live fragment the
pages poll, is requested ``--requests`` times one at a time; the table gives the wall time of a
request on the same machine (server time plus a local round trip).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx
from sqlalchemy import text

from bench.api import api_process, print_table
from bench.common import environment, kept_database, percentile
from bench.instance_data import Spread, fill, register_jobs
from jobplane.errors import JobNotFoundError
from jobplane.store.sql import SqlStore


def pages(job: str, cron_job: str, instance: str, fifth: str) -> list[tuple[str, str]]:
    return [
        ("Overview", "/"),
        ("Overview (live fragment)", "/?partial=1"),
        ("Jobs", "/jobs"),
        ("Jobs, filtered", "/jobs?kind=recurring&q=bench"),
        ("Job (recurring)", f"/jobs/{cron_job}"),
        ("Job (live instances)", f"/jobs/{job}?partial=instances"),
        ("Instances", "/instances"),
        ("Instances, failed", "/instances?state=failed&state=terminated"),
        ("Instances, one job, last 24 h", f"/instances?job={job}&since=24h"),
        ("Instances, 5th page", fifth),
        ("Overview, one app", "/apps/bench-cron/"),
        ("Jobs, one app", "/apps/bench-cron/jobs"),
        ("Instances, one app (recurring jobs)", "/apps/bench-cron/instances"),
        ("Instances, one app (triggered jobs)", "/apps/bench/instances"),
        ("Instance", f"/instances/{instance}"),
        ("Workers", "/workers"),
        ("Workers, one app", "/apps/bench-cron/workers"),
    ]


async def fifth_page(client: httpx.AsyncClient) -> str:
    """The URL of the 5th keyset page of the unfiltered list, by following "Older →"."""
    path = "/instances"
    for _ in range(4):
        body = (await client.get(path)).text
        marker = 'href="/instances?before='
        path = "/instances?before=" + body.split(marker, 1)[1].split('"', 1)[0]
    return path


async def _filled(store: SqlStore, spread: Spread) -> bool:
    """Whether a kept database was filled by an earlier run (its jobs are registered)."""
    try:
        return bool(await store.definition_history(spread.job_keys[0]))
    except JobNotFoundError:
        return False


async def main(ns: argparse.Namespace) -> None:
    spread = Spread(ns.instances)
    database = kept_database(ns.keep) if ns.keep else environment()
    async with database as (url, prefix, store):
        if not await _filled(store, spread):
            await register_jobs(store, spread)
            started = time.perf_counter()
            await fill(store.engine, spread)
            print(f"filled {ns.instances:,} instances in {time.perf_counter() - started:.1f} s")
        async with store.engine.connect() as conn:
            instance = (
                await conn.execute(text("SELECT id FROM job_instances ORDER BY id DESC LIMIT 1"))
            ).scalar()
        async with (
            api_process(url, prefix) as base,
            httpx.AsyncClient(base_url=base, timeout=60) as client,
        ):
            await client.get("/jobs")  # the session cookie and warm caches
            keys = spread.job_keys
            rows: list[tuple[str, ...]] = []
            listing = pages(keys[-1], keys[0], str(instance), await fifth_page(client))
            for name, path in listing:
                took = []
                for _ in range(ns.requests):
                    sent = time.perf_counter()
                    response = await client.get(path)
                    took.append(time.perf_counter() - sent)
                    assert response.status_code == 200, (path, response.status_code)
                rows.append(
                    (
                        name,
                        f"{percentile(took, 0.50) * 1000:.1f}",
                        f"{percentile(took, 0.95) * 1000:.1f}",
                        f"{max(took) * 1000:.1f}",
                        "yes" if percentile(took, 0.95) * 1000 < ns.target_ms else "NO",
                    )
                )
    print_table(
        f"Dashboard pages, {ns.instances:,} instances, one request at a time",
        ("page", "p50 ms", "p95 ms", "max ms", f"<{ns.target_ms:g}"),
        rows,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--instances", type=int, default=1_000_000)
    parser.add_argument("--requests", type=int, default=20, help="requests per page")
    parser.add_argument(
        "--keep",
        metavar="NAME",
        help="fill the database NAME once and keep it (later runs reuse it, migrated to head)",
    )
    parser.add_argument("--target-ms", type=float, default=100.0, help="p95 target per page")
    asyncio.run(main(parser.parse_args()))
