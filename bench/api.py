"""The REST API under load: trigger throughput, and instance listings on a large table.

    .venv/bin/python -m bench.api [--instances 1000000] [--seconds 5] [--in-flight 4 32]

A real ``jobplane api`` process (uvicorn) serves a fresh Postgres database and a Redis key
prefix of its own; the benchmark is its HTTP client.

1. Triggers: ``POST /api/v1/jobs/{key}/instances`` with ``--in-flight`` requests at once (each
   value in turn) for ``--seconds``, then ``POST /api/v1/instances/batch`` with 100 and with
   1000 items per call.
2. Listings: ``job_instances`` is emptied and filled with ``--instances`` rows in SQL
   (bench/instance_data.py), then ``GET /api/v1/instances`` is timed one request at a time,
   ``--requests`` per filter and for keyset pages followed ``--pages`` deep. A filter whose p95
   misses ``--target-ms`` gets the EXPLAIN ANALYZE of the SQL the store sends for its slowest
   request (of every filter with ``--explain-all``). ``--after-fill-sql`` runs a statement (a
   candidate index) before the timing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
from sqlalchemy import text

from bench.common import REDIS_URL, ROOT, environment, percentile
from bench.instance_data import Spread, clear, fill, register_jobs
from bench.listing import Timing, explain, list_scenarios, time_listing
from jobplane.domain.options import JobOptions

TRIGGER_PATH = "/api/v1/jobs/noop/instances"
BATCH_PATH = "/api/v1/instances/batch"


@asynccontextmanager
async def api_process(url: str, prefix: str, workers: int | None = None) -> AsyncIterator[str]:
    """A ``jobplane api`` subprocess without auth on a free port (``JOBPLANE_API_WORKERS``
    set to ``workers`` when given); yields its base URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {
        **os.environ,
        "JOBPLANE_DATABASE_URL": url,
        "JOBPLANE_REDIS_URL": REDIS_URL,
        "JOBPLANE_KEY_PREFIX": prefix,
        "JOBPLANE_AUTH_ENABLED": "false",
        "JOBPLANE_LOG_LEVEL": "WARNING",
    }
    if workers is not None:
        env["JOBPLANE_API_WORKERS"] = str(workers)
    command = [str(Path(sys.executable).parent / "jobplane"), "api", "--host", "127.0.0.1"]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [*command, "--port", str(port)], cwd=ROOT, env=env, stdout=log, stderr=log
        )
        base = f"http://127.0.0.1:{port}"
        try:
            await _wait_ready(base, proc)
            yield base
        except BaseException:
            log.seek(0)
            print(log.read()[-4000:].decode(errors="replace"), file=sys.stderr)
            raise
        finally:
            proc.terminate()
            proc.wait(timeout=30)


async def _wait_ready(base: str, proc: subprocess.Popen[bytes]) -> None:
    async with httpx.AsyncClient(base_url=base) as client:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"jobplane api exited with {proc.returncode}")
            try:
                if (await client.get("/readyz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
    raise TimeoutError("jobplane api was not ready within 60 s")


async def _load(
    client: httpx.AsyncClient, path: str, body: object, seconds: float, in_flight: int
) -> tuple[int, float, list[float]]:
    """POST ``body`` to ``path`` from ``in_flight`` loops for ``seconds``: (calls, elapsed s,
    latencies in s)."""
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def loop() -> None:
        while time.perf_counter() < deadline:
            sent = time.perf_counter()
            response = await client.post(path, json=body)
            response.raise_for_status()
            latencies.append(time.perf_counter() - sent)

    started = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(in_flight)))
    return len(latencies), time.perf_counter() - started, latencies


async def bench_triggers(base: str, seconds: float, in_flight: list[int]) -> list[tuple[str, ...]]:
    """Rows of the trigger table: what, instances/s, p50 ms, p99 ms."""
    most = max(in_flight)
    limits = httpx.Limits(max_connections=most, max_keepalive_connections=most)
    out: list[tuple[str, ...]] = []
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=60) as client:
        await _load(client, TRIGGER_PATH, {}, 0.5, most)  # warm-up: connections, caches
        for flying in in_flight:
            calls, elapsed, lat = await _load(client, TRIGGER_PATH, {}, seconds, flying)
            out.append((f"single, {flying} in flight", *_rate(calls, elapsed, lat)))
        for size, flying in ((100, 2), (1000, 2)):
            body = {"items": [{"job_key": "noop"} for _ in range(size)]}
            calls, elapsed, lat = await _load(client, BATCH_PATH, body, seconds, flying)
            out.append((f"batch of {size}, {flying} in flight", *_rate(calls * size, elapsed, lat)))
    return out


def _rate(instances: int, elapsed: float, latencies: list[float]) -> tuple[str, str, str]:
    return (
        f"{instances / elapsed:,.0f}",
        f"{percentile(latencies, 0.50) * 1000:.1f}",
        f"{percentile(latencies, 0.99) * 1000:.1f}",
    )


def print_table(title: str, header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n{title}")
    for row in [header, *rows]:
        rest = zip(row[1:], widths[1:], strict=True)
        cells = [row[0].ljust(widths[0]), *(c.rjust(w) for c, w in rest)]
        print("  ".join(cells).rstrip())


async def main(ns: argparse.Namespace) -> None:
    spread = Spread(ns.instances)
    async with environment() as (url, prefix, store):
        await store.register_definition(
            JobOptions.parse(key="noop", kind="triggered", max_concurrency=1_000_000), None, "bench"
        )
        await register_jobs(store, spread)
        async with api_process(url, prefix) as base:
            rows = await bench_triggers(base, ns.seconds, ns.in_flight)
            print_table("Trigger over REST", ("request", "instances/s", "p50 ms", "p99 ms"), rows)

            await clear(store.engine)
            started = time.perf_counter()
            first, last = await fill(store.engine, spread)
            print(f"\nfilled {ns.instances:,} instances in {time.perf_counter() - started:.1f} s")
            for sql in ns.after_fill_sql:
                async with store.engine.connect() as conn:
                    await conn.execution_options(isolation_level="AUTOCOMMIT")
                    await conn.execute(text(sql))
                    await conn.execute(text("ANALYZE job_instances"))
                print(f"ran: {sql}")

            scenarios = list_scenarios(spread, first, last)
            timings: list[Timing] = []
            async with httpx.AsyncClient(base_url=base, timeout=60) as client:
                for scenario in scenarios:
                    timings.append(await time_listing(client, scenario, ns.requests, ns.pages))
        print_table(
            f"GET /api/v1/instances, {ns.instances:,} rows, limit 50, one request at a time",
            ("filter", "requests", "rows/page", "p50 ms", "p95 ms", "p99 ms", f"<{ns.target_ms}"),
            [t.row(ns.target_ms) for t in timings],
        )
        for timing in timings:
            if ns.explain_all or timing.p95_ms >= ns.target_ms:
                print(f"\n{timing.name}: p95 {timing.p95_ms:.1f} ms; slowest request's plan:")
                print(await explain(store, timing.slowest))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--instances", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=5.0, help="per trigger measurement")
    parser.add_argument(
        "--in-flight", type=int, nargs="+", default=[4, 32], help="concurrent single triggers"
    )
    parser.add_argument("--requests", type=int, default=200, help="list requests per filter")
    parser.add_argument("--pages", type=int, default=5, help="depth of a keyset page chain")
    parser.add_argument("--target-ms", type=float, default=50.0, help="p95 target of listings")
    parser.add_argument("--after-fill-sql", action="append", default=[], metavar="SQL")
    parser.add_argument("--explain-all", action="store_true", help="plans of every filter")
    asyncio.run(main(parser.parse_args()))
