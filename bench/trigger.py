"""The trigger path on Postgres + Redis: one trigger at a time, over REST, and enqueue → start.

    .venv/bin/python -m bench.trigger [--seconds 5] [--api-workers 1 2] [--rate 100]
        [--raw-client] [--parts 1 2 3]

1. ``Dispatcher.trigger`` called one at a time, awaited (the Python API in the caller's
   process): triggers/s, p50 and p99 of one call.
2. The Python :class:`~jobplane.client.AsyncClient` against a real ``jobplane api`` process
   (``JOBPLANE_API_WORKERS`` = each ``--api-workers`` value in turn), with 1 and with 16
   requests in flight: triggers/s, p50 and p99 of one request. Client and server share the
   machine. With ``--raw-client``, the same again over plain keep-alive HTTP/1.1 connections
   (:class:`RawTrigger`): a client of a few microseconds per request, so the figure is the
   API's rather than httpx's (which costs more CPU per request than the API).
3. Latency from the trigger call to the job's start, with two worker processes running, at a
   steady ``--rate`` triggers/s for ``--seconds``: p50 and p99 of ``started_at`` (the claim,
   the database's clock) minus the moment the trigger call began (read on the database's clock
   too, through the offset measured at start). Then the same for each stage on the way: the
   trigger's statement began (the instance's ``created_at``), its Enqueued transition was
   written, the publish call returned (this process's clock, through the same offset), the
   claim updated the row.

Every instance is written with its history, as in production; each part has a fresh database.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, cast
from uuid import UUID

from sqlalchemy import text

from bench.api import api_process, print_table
from bench.common import bus_for, environment, percentile, spawn_worker, wait_until
from jobplane.bus.abc import Bus
from jobplane.bus.envelope import Envelope
from jobplane.client import AsyncClient
from jobplane.dispatch import Dispatcher
from jobplane.domain.options import JobOptions
from jobplane.domain.states import InstanceState
from jobplane.store.sql import SqlStore

KEY = "noop"
IN_FLIGHT = (1, 16)


async def _define(store: SqlStore) -> None:
    options = JobOptions.parse(key=KEY, kind="triggered", max_concurrency=1_000_000)
    await store.register_definition(options, None, "bench")


async def _loops(
    call: Callable[[], Awaitable[object]], seconds: float, in_flight: int
) -> tuple[str, str, str]:
    """``call`` from ``in_flight`` loops for ``seconds``: (calls/s, p50 ms, p99 ms)."""
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def loop() -> None:
        while time.perf_counter() < deadline:
            sent = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - sent)

    started = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(in_flight)))
    elapsed = time.perf_counter() - started
    return (
        f"{len(latencies) / elapsed:,.0f}",
        f"{percentile(latencies, 0.50) * 1000:.2f}",
        f"{percentile(latencies, 0.99) * 1000:.2f}",
    )


async def bench_dispatcher(seconds: float) -> tuple[str, ...]:
    async with environment() as (_url, prefix, store):
        await _define(store)
        bus = bus_for(prefix)
        try:
            async with Dispatcher(store, bus) as dispatcher:
                await _loops(lambda: dispatcher.trigger(KEY), 0.5, 1)  # warm-up
                return (
                    "Dispatcher.trigger, 1 in flight",
                    *await _loops(lambda: dispatcher.trigger(KEY), seconds, 1),
                )
        finally:
            await bus.close()


async def bench_rest(seconds: float, workers: int, raw: bool) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    async with environment() as (url, prefix, store):
        await _define(store)
        async with api_process(url, prefix, workers) as base, AsyncClient(base) as client:
            await _loops(lambda: client.trigger(KEY), 1.0, max(IN_FLIGHT))  # warm-up
            for flying in IN_FLIGHT:
                rates = await _loops(lambda: client.trigger(KEY), seconds, flying)
                out.append((f"REST, api workers {workers}, {flying} in flight", *rates))
            if raw:
                for flying in IN_FLIGHT:
                    async with RawTrigger.open(base, flying) as posts:
                        rates = await _loops(posts.trigger, seconds, flying)
                    name = f"REST, raw HTTP client, api workers {workers}, {flying} in flight"
                    out.append((name, *rates))
    return out


class RawTrigger:
    """The trigger request over plain keep-alive HTTP/1.1 connections, one per request in
    flight: a client that costs a few microseconds per request, where ``AsyncClient`` (httpx)
    costs more CPU than the API's handling of it. It measures what the API serves when the
    client is not what shares its cores."""

    REQUEST = (
        f"POST /api/v1/jobs/{KEY}/instances HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        "Content-Type: application/json\r\nContent-Length: 13\r\n\r\n"
        '{"args":null}'
    ).encode()

    def __init__(self, connections: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]):
        self._idle = connections

    @classmethod
    @asynccontextmanager
    async def open(cls, base: str, count: int) -> AsyncIterator[RawTrigger]:
        host, port = base.removeprefix("http://").split(":")
        connections = [await asyncio.open_connection(host, int(port)) for _ in range(count)]
        try:
            yield cls(list(connections))
        finally:
            for _, writer in connections:
                writer.close()

    async def trigger(self) -> None:
        reader, writer = self._idle.pop()
        try:
            writer.write(self.REQUEST)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 201"):
                raise RuntimeError(f"trigger refused: {head[:80]!r}")
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            await reader.readexactly(length)
        finally:
            self._idle.append((reader, writer))


class _TimedBus:
    """The bench's bus, noting when each message's publish call returned (epoch seconds)."""

    def __init__(self, bus: Bus) -> None:
        self._bus = bus
        self.sent: dict[UUID, float] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bus, name)

    async def publish(self, envelopes: Sequence[tuple[str, Envelope]]) -> None:
        await self._bus.publish(envelopes)
        now = time.time()
        for _, envelope in envelopes:
            self.sent[envelope.instance_id] = now


async def bench_latency(seconds: float, rate: float) -> list[tuple[str, ...]]:
    """Enqueue → start at a steady ``rate`` with two worker processes; then where the time
    went, stage by stage (each after the call began, on the database's clock)."""
    async with environment() as (url, prefix, store):
        await _define(store)
        bus = _TimedBus(bus_for(prefix))
        procs = [spawn_worker(url, prefix, i, 64) for i in range(2)]
        try:
            dispatcher = Dispatcher(store, cast(Bus, bus))
            await _workers_ready(store, dispatcher)
            offset = await _clock_offset(store)
            sent: dict[UUID, float] = {}
            count = int(seconds * rate)
            began = time.perf_counter()
            for n in range(count):
                # A steady pace: each call at its slot, not after the previous one plus 1/rate.
                pause = began + n / rate - time.perf_counter()
                if pause > 0:
                    await asyncio.sleep(pause)
                at = time.time()
                instance = await dispatcher.trigger(KEY)
                sent[instance.id] = at + offset

            async def started() -> bool:
                counts = await store.count_by_state(KEY)
                return counts.get(InstanceState.SUCCEEDED, 0) >= count + 1

            await wait_until(started, 60)
            stages = await _stages(store)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(timeout=60)
            await bus.close()
    published = {i: t + offset for i, t in bus.sent.items()}
    delays = [stages[i]["claimed"] - t for i, t in sent.items()]
    rows: list[tuple[str, ...]] = [
        (
            f"trigger → start at {rate:.0f}/s, 2 workers",
            f"{len(delays)} jobs",
            f"{percentile(delays, 0.50) * 1000:.2f}",
            f"{percentile(delays, 0.99) * 1000:.2f}",
        )
    ]
    for stage, label in STAGES:
        after = [
            (published[i] if stage == "published" else stages[i][stage]) - t
            for i, t in sent.items()
        ]
        rows.append(
            (
                f"  {label}",
                "",
                f"{percentile(after, 0.50) * 1000:.2f}",
                f"{percentile(after, 0.99) * 1000:.2f}",
            )
        )
    return rows


#: The trigger → start path's stages, in order, as ``bench_latency`` prints them.
STAGES = (
    ("statement", "the trigger's statement began (now())"),
    ("recorded", "its Enqueued transition written"),
    ("published", "the publish call returned"),
    ("claimed", "the claim updated the row (started_at)"),
)


async def _workers_ready(store: SqlStore, dispatcher: Dispatcher) -> None:
    """Both workers consume: one instance is triggered and has run."""
    await wait_until(lambda: _count_workers(store, 2), 60)
    await dispatcher.trigger(KEY)

    async def ran() -> bool:
        return (await store.count_by_state(KEY)).get(InstanceState.SUCCEEDED, 0) >= 1

    await wait_until(ran, 60)
    await asyncio.sleep(1)  # both consumers are blocked on their stream reads


async def _count_workers(store: SqlStore, n: int) -> bool:
    async with store.engine.connect() as conn:
        found = (await conn.execute(text("SELECT count(*) FROM workers"))).scalar_one()
    return int(found) >= n


async def _clock_offset(store: SqlStore) -> float:
    """The database's clock minus this process's (seconds), from the fastest of 20 reads."""
    best: tuple[float, float] | None = None
    for _ in range(20):
        before = time.time()
        now = await store.now()
        after = time.time()
        if best is None or after - before < best[0]:
            best = (after - before, now.timestamp() - (before + after) / 2)
    assert best is not None
    return best[1]


async def _stages(store: SqlStore) -> dict[object, dict[str, float]]:
    """Per instance, the stages the database recorded (epoch seconds, its clock)."""
    async with store.engine.connect() as conn:
        found = await conn.execute(
            text(
                "SELECT i.id, extract(epoch FROM i.created_at) AS statement,"
                " extract(epoch FROM t.at) AS recorded, extract(epoch FROM i.started_at)"
                " AS claimed FROM job_instances i JOIN instance_transitions t"
                " ON t.instance_id = i.id AND t.from_state IS NULL"
            )
        )
        return {
            row.id: {
                "statement": float(row.statement),
                "recorded": float(row.recorded),
                "claimed": float(row.claimed),
            }
            for row in found
        }


async def main(ns: argparse.Namespace) -> None:
    rows: list[tuple[str, ...]] = []
    if 1 in ns.parts:
        rows.append(await bench_dispatcher(ns.seconds))
    if 2 in ns.parts:
        for workers in ns.api_workers:
            rows += await bench_rest(ns.seconds, workers, ns.raw_client)
    if rows:
        print_table("Trigger", ("path", "triggers/s", "p50 ms", "p99 ms"), rows)
    if 3 in ns.parts and ns.rate > 0:
        latency = await bench_latency(ns.seconds * 2, ns.rate)
        print_table("Latency", ("path", "measured", "p50 ms", "p99 ms"), latency)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=5.0, help="per measurement")
    parser.add_argument("--api-workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rate", type=float, default=100.0, help="triggers/s (0: skip)")
    parser.add_argument(
        "--raw-client",
        action="store_true",
        help="also trigger over plain keep-alive HTTP/1.1 (a client that costs little CPU)",
    )
    parser.add_argument(
        "--parts", type=int, nargs="+", choices=(1, 2, 3), default=[1, 2, 3], help="which parts"
    )
    asyncio.run(main(parser.parse_args()))
