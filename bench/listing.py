"""Timed ``GET /api/v1/instances`` requests with typical filters, and the plan of a slow one."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import httpx
from sqlalchemy import event

from bench.common import percentile
from bench.instance_data import Spread
from jobplane.domain.models import InstanceFilter
from jobplane.domain.states import InstanceState
from jobplane.store.sql import SqlStore

LIST_PATH = "/api/v1/instances"
WARM_UP = 10
WINDOW = timedelta(hours=6)


@dataclass(frozen=True, slots=True)
class Query:
    """One listing: the same filter as query parameters and as the store's InstanceFilter."""

    job: str | None = None
    states: tuple[InstanceState, ...] = ()
    created_after: datetime | None = None
    created_before: datetime | None = None
    worker: str | None = None

    def params(self, before: UUID | None) -> httpx.QueryParams:
        values = {
            "job": self.job,
            "created_after": self.created_after.isoformat() if self.created_after else None,
            "created_before": self.created_before.isoformat() if self.created_before else None,
            "worker": self.worker,
            "before": str(before) if before else None,
        }
        pairs = [("state", s.value) for s in self.states]
        pairs += [(name, value) for name, value in values.items() if value is not None]
        return httpx.QueryParams(tuple(pairs))

    def filter(self) -> InstanceFilter:
        return InstanceFilter(
            job_key=self.job,
            states=self.states,
            created_after=self.created_after,
            created_before=self.created_before,
            worker_id=self.worker,
        )


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    make: Callable[[random.Random], Query]
    paged: bool = False  # follow ``next_cursor`` from each query's first page


@dataclass(slots=True)
class Timing:
    name: str
    latencies: list[float] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    slowest: tuple[Query, UUID | None] = (Query(), None)
    slowest_s: float = 0.0

    @property
    def p95_ms(self) -> float:
        return percentile(self.latencies, 0.95) * 1000

    def row(self, target_ms: float) -> tuple[str, ...]:
        return (
            self.name,
            str(len(self.latencies)),
            f"{sum(self.rows) / len(self.rows):.0f}",
            *(f"{percentile(self.latencies, q) * 1000:.1f}" for q in (0.50, 0.95, 0.99)),
            "yes" if self.p95_ms < target_ms else "NO",
        )


def list_scenarios(spread: Spread, first: datetime, last: datetime) -> list[Scenario]:
    """The filters an operator uses, each drawn at random (seeded) over the table's spread."""
    states = list(InstanceState)

    def job(rng: random.Random) -> str:
        return rng.choice(spread.job_keys)

    def window(rng: random.Random) -> Query:
        after = first + (last - first - WINDOW) * rng.random()
        return Query(created_after=after, created_before=after + WINDOW)

    def worker(rng: random.Random) -> Query:
        return Query(worker=rng.choice(spread.worker_ids(rng.randrange(spread.deploys))))

    return [
        Scenario("none", lambda rng: Query()),
        Scenario("job", lambda rng: Query(job=job(rng))),
        Scenario("state", lambda rng: Query(states=(rng.choice(states),))),
        Scenario("two states", lambda rng: Query(states=tuple(rng.sample(states, 2)))),
        Scenario("job + state", lambda rng: Query(job=job(rng), states=(rng.choice(states),))),
        Scenario("6 h created window", window),
        Scenario("worker", worker),
        Scenario("pages: none", lambda rng: Query(), paged=True),
        Scenario("pages: job", lambda rng: Query(job=job(rng)), paged=True),
    ]


async def time_listing(
    client: httpx.AsyncClient, scenario: Scenario, requests: int, depth: int
) -> Timing:
    """``requests`` timed GETs (after a few untimed ones), following cursors ``depth`` deep
    when the scenario pages."""
    rng = random.Random(scenario.name)
    timing = Timing(scenario.name)
    pages = depth if scenario.paged else 1
    sent = 0
    while sent < requests + WARM_UP:
        query, before = scenario.make(rng), None
        for _ in range(pages):
            started = time.perf_counter()
            response = await client.get(LIST_PATH, params=query.params(before))
            elapsed = time.perf_counter() - started
            response.raise_for_status()
            page: dict[str, Any] = response.json()
            sent += 1
            if sent > WARM_UP:
                timing.latencies.append(elapsed)
                timing.rows.append(len(page["items"]))
                if elapsed > timing.slowest_s:
                    timing.slowest, timing.slowest_s = (query, before), elapsed
            cursor = page["next_cursor"]
            if cursor is None or sent >= requests + WARM_UP:
                break
            before = UUID(cursor)
    return timing


async def explain(store: SqlStore, request: tuple[Query, UUID | None]) -> str:
    """EXPLAIN (ANALYZE, BUFFERS) of the statement ``store.list_instances`` sends for it."""
    query, before = request
    captured: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, statement: str, parameters: Any, *rest: Any) -> None:
        captured.append((statement, parameters))

    sync_engine = store.engine.sync_engine
    event.listen(sync_engine, "before_cursor_execute", capture)
    try:
        await store.list_instances(query.filter(), limit=50, before=before)
    finally:
        event.remove(sync_engine, "before_cursor_execute", capture)
    statement, parameters = next((s, p) for s, p in captured if "job_instances" in s)
    async with store.engine.connect() as conn:
        result = await conn.exec_driver_sql("EXPLAIN (ANALYZE, BUFFERS) " + statement, parameters)
        plan = "\n".join(f"  {line}" for (line,) in result)
    where = " ".join(statement[statement.index("FROM job_instances") :].split())
    return f"  SELECT job_instances.* {where}\n  parameters: {parameters}\n{plan}"
