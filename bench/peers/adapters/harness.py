"""The phases every system goes through, in the same order and with the same clocks; an adapter
only says how its system enqueues a job and how its workers start. Standard library only: it
runs inside each peer's own environment.

1. Idle memory: the two worker processes start on an empty queue; RSS once it is steady.
2. Single enqueue: one call at a time, awaited, for ``single_s`` (or a quarter of the jobs).
   Bulk enqueue: the rest of ``jobs``, 1,000 per call, with the system's bulk API; a system
   without one enqueues the rest singly (and its single rate covers every call).
3. Drain: the workers start on that backlog; the clock runs from just before the first worker
   process starts to the start of the last job (the no-op job's body is the probe). RSS again.
4. Latency: jobs sent at ``rate`` per second for ``latency_s``; each carries ``time.time()``
   taken just before its enqueue call, and the job subtracts it from its own start time.

A client whose ``in_flight`` is set is also measured with that many single calls at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from bench.peers.adapters import probe
from bench.peers.adapters.processes import Memory, Workers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BULK_CHUNK = 1000


@dataclass(frozen=True)
class Config:
    """What the driver passes (as JSON) to every adapter."""

    jobs: int
    single_s: float
    rate: float
    latency_s: float
    idle_s: float
    concurrency: int
    redis_url: str
    postgres_url: str

    @classmethod
    def from_argv(cls) -> Config:
        return cls(**json.loads(sys.argv[-1]))


class Client(Protocol):
    """One way of enqueueing the no-op job (a row of the table)."""

    # Read-only members (properties), so that an adapter's plain class attribute matches them
    # (``in_flight = None`` is of type ``None``, which a settable ``int | None`` would refuse).

    @property
    def label(self) -> str:
        """The row's label."""

    @property
    def in_flight(self) -> int | None:
        """Extra measurement: this many single calls in flight at once (``None``: not measured)."""

    @property
    def has_bulk(self) -> bool:
        """Whether :meth:`bulk` exists (one call enqueues many jobs)."""

    async def single(self, sent: float) -> None:
        """Enqueue one job with argument ``sent``; return once the system acknowledged it."""

    async def bulk(self, count: int) -> None:
        """Enqueue ``count`` jobs (argument 0) in one call (only if ``has_bulk``)."""


class Described(Protocol):
    """What a row of the table says about the system."""

    name: str
    version: str
    #: What the system keeps of a job after it ran (a table column).
    keeps: str
    notes: Sequence[str]


class System(Described, Protocol):
    async def setup(self, config: Config) -> Sequence[Client]:
        """Create what the system needs (database, schema); the clients, first is the main."""

    def worker_commands(self, config: Config) -> Sequence[Sequence[str]]:
        """The commands that start the two worker processes (one command per tree)."""

    def worker_env(self, config: Config) -> dict[str, str]:
        """Extra environment of the workers."""

    async def teardown(self) -> None:
        """Remove what setup created."""


def installed(script: str) -> str:
    """The console script ``script`` of the peer's environment (beside this interpreter)."""
    return str(Path(sys.executable).parent / script)


def redis_url() -> str:
    """The run's Redis (the driver sets ``PEERS_REDIS_URL``), for brokers built at import time
    in the adapter and its workers alike. Unset (the module imported on its own), a port
    nothing listens on: never a Redis that happens to run here."""
    return os.environ.get("PEERS_REDIS_URL", "redis://127.0.0.1:1")


def concurrency_env(config: Config) -> dict[str, str]:
    """The workers' environment that passes ``config.concurrency`` to systems whose worker
    settings live in the adapter module (read there by :func:`worker_concurrency`)."""
    return {"PEERS_CONCURRENCY": str(config.concurrency)}


def worker_concurrency() -> int:
    """In a worker process: the concurrency :func:`concurrency_env` passed."""
    return int(os.environ.get("PEERS_CONCURRENCY", "10"))


class SingleCalls:
    """The one client of a system measured through its single enqueue only: an unlabelled row,
    no bulk API (the harness enqueues the whole backlog singly), no in-flight figure.
    Subclasses define :meth:`Client.single`."""

    label = ""
    in_flight = None
    has_bulk = False

    async def bulk(self, count: int) -> None:
        raise NotImplementedError("no bulk API: the harness enqueues one job per call")


class NoWorkerEnv:
    """For a system whose workers need nothing but the inherited environment."""

    def worker_env(self, config: Config) -> dict[str, str]:
        return {}


@dataclass
class ClientRow:
    label: str
    single_calls: int = 0
    single_s: float = 0.0
    bulk_calls: int = 0
    bulk_s: float = 0.0
    in_flight: int | None = None
    in_flight_per_s: float | None = None
    latency: dict[str, float] = field(default_factory=dict)


async def run(system: System, config: Config) -> list[dict[str, Any]]:
    clients = await system.setup(config)
    try:
        rows = [ClientRow(c.label, in_flight=c.in_flight) for c in clients]
        with tempfile.TemporaryDirectory(prefix="peers-idle-") as probe_dir:
            workers = _workers(system, config, probe_dir)
            workers.start()
            try:
                idle = await workers.settle(config.idle_s)
            finally:
                workers.stop()
        enqueued = drain_jobs = await _enqueue(clients, rows, config)
        with tempfile.TemporaryDirectory(prefix="peers-probe-") as probe_dir:
            workers = _workers(system, config, probe_dir)
            started = workers.start()
            try:
                timeout_s = 60 + enqueued / 20  # slower than 20 jobs/s is a broken run
                totals = await _wait_probe(workers, probe_dir, enqueued, timeout_s)
                drain_s, busy_s = totals.last - started, totals.last - totals.first
                drained = workers.memory()
                for client, row in zip(clients, rows, strict=True):
                    enqueued += await _latency(workers, client, row, config, probe_dir, enqueued)
            finally:
                workers.stop()
    finally:
        await system.teardown()
    drain = (drain_jobs, drain_s, busy_s)
    return [_row(system, rows[i], i, drain, idle, drained) for i in range(len(rows))]


def _workers(system: System, config: Config, probe_dir: str) -> Workers:
    env = {**os.environ, **system.worker_env(config), "PEERS_PROBE_DIR": probe_dir}
    env["PYTHONPATH"] = ROOT
    return Workers(system.worker_commands(config), env, ROOT)


async def _enqueue(clients: Sequence[Client], rows: list[ClientRow], config: Config) -> int:
    """Single, in-flight and bulk enqueues of every client, up to ``config.jobs`` in all."""
    cap = max(1, config.jobs // (4 * len(clients)))
    total = 0
    for client, row in zip(clients, rows, strict=True):
        row.single_calls, row.single_s = await _singles(client.single, cap, config.single_s)
        total += row.single_calls
        if client.in_flight:
            calls, seconds = await _in_flight(client.single, client.in_flight, cap, config.single_s)
            row.in_flight_per_s = calls / seconds
            total += calls
    bulk_clients = [(c, r) for c, r in zip(clients, rows, strict=True) if c.has_bulk]
    for i, (client, row) in enumerate(bulk_clients):
        share = (config.jobs - total) // (len(bulk_clients) - i)
        row.bulk_calls, row.bulk_s = await _bulk(client, share)
        total += row.bulk_calls
    if not bulk_clients and total < config.jobs:
        calls, seconds = await _singles(clients[0].single, config.jobs - total, 1e9)
        rows[0].single_calls += calls
        rows[0].single_s += seconds
        total += calls
    return total


async def _singles(
    enqueue: Callable[[float], Awaitable[None]], cap: int, limit_s: float
) -> tuple[int, float]:
    started = time.perf_counter()
    calls = 0
    while calls < cap and time.perf_counter() - started < limit_s:
        await enqueue(0.0)
        calls += 1
    return calls, time.perf_counter() - started


async def _in_flight(
    enqueue: Callable[[float], Awaitable[None]], in_flight: int, cap: int, limit_s: float
) -> tuple[int, float]:
    started = time.perf_counter()
    calls = 0

    async def loop() -> None:
        nonlocal calls
        while calls < cap and time.perf_counter() - started < limit_s:
            calls += 1
            await enqueue(0.0)

    await asyncio.gather(*(loop() for _ in range(in_flight)))
    return calls, time.perf_counter() - started


async def _bulk(client: Client, count: int) -> tuple[int, float]:
    started = time.perf_counter()
    done = 0
    while done < count:
        n = min(BULK_CHUNK, count - done)
        await client.bulk(n)
        done += n
    return done, time.perf_counter() - started


async def _wait_probe(
    workers: Workers, probe_dir: str, expected: int, timeout_s: float
) -> probe.Totals:
    deadline = time.monotonic() + timeout_s
    while True:
        totals = probe.read(probe_dir)
        if totals.done >= expected:
            return totals
        if time.monotonic() > deadline:
            raise TimeoutError(f"{totals.done} of {expected} jobs ran in {timeout_s:.0f} s")
        workers.check_alive()
        await asyncio.sleep(0.01)


async def _latency(
    workers: Workers, client: Client, row: ClientRow, config: Config, probe_dir: str, before: int
) -> int:
    """Send jobs at ``config.rate`` for ``config.latency_s``; returns how many were sent."""
    count = max(1, int(config.rate * config.latency_s))
    already = {pid: len(seen) for pid, seen in probe.read(probe_dir).latencies.items()}
    started = time.perf_counter()
    for i in range(count):
        delay = started + i / config.rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        await client.single(time.time())
    sent_s = time.perf_counter() - started
    totals = await _wait_probe(workers, probe_dir, before + count, timeout_s=60)
    new = [x for pid, seen in totals.latencies.items() for x in seen[already.get(pid, 0) :]]
    ms = sorted(x * 1000 for x in new) or [float("nan")]
    row.latency = {
        "rate": count / sent_s,
        "jobs": count,
        "p50_ms": ms[len(ms) // 2],
        "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
    }
    return count


def _row(
    system: Described,
    row: ClientRow,
    index: int,
    drain: tuple[int, float, float],
    idle: Memory,
    drained: Memory,
) -> dict[str, Any]:
    """The JSON contract of one table row (bench/peers/table.py reads it). The drain and the
    memory belong to the system: only its first row carries them."""
    first = index == 0
    jobs, drain_s, busy_s = drain
    return {
        "system": system.name,
        "version": system.version,
        "client": row.label,
        "keeps": system.keeps,
        "notes": list(system.notes) if first else [],
        "drain_jobs": jobs if first else None,
        "drain_per_s": jobs / drain_s if first else None,
        "drain_busy_per_s": jobs / busy_s if first else None,
        "single_per_s": row.single_calls / row.single_s if row.single_calls else None,
        "single_calls": row.single_calls,
        "in_flight": row.in_flight,
        "in_flight_per_s": row.in_flight_per_s,
        "bulk_per_s": row.bulk_calls / row.bulk_s if row.bulk_calls else None,
        "latency_rate": row.latency.get("rate"),
        "latency_p50_ms": row.latency.get("p50_ms"),
        "latency_p99_ms": row.latency.get("p99_ms"),
        "rss_idle_mb": idle.workers_mb if first else None,
        "rss_drained_mb": drained.workers_mb if first else None,
        "worker_processes": idle.workers if first else None,
        "supervisor_mb": drained.supervisors_mb if first else None,
        "supervisors": drained.supervisors if first else None,
    }


def main(system: System) -> None:
    """Entry point of an adapter: config from argv, the rows as one JSON line on stdout."""
    config = Config.from_argv()
    # SIGTERM from the driver unwinds like Ctrl-C, so that the workers are stopped.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    rows = asyncio.run(run(system, config))
    print(json.dumps(rows))
