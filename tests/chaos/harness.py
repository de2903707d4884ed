"""The whole system under load and overlapping faults, then a quiet period, then the checker.

``Harness`` owns its servers (never the shared ones), the role processes and their proxies;
``run`` returns a :class:`Report` whose violations must all be zero."""

from __future__ import annotations

import asyncio
import random
import secrets
import signal
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from types import TracebackType

import httpx
import redis.asyncio as aioredis
from sqlalchemy import func, select

from jobplane.domain.states import TERMINAL_STATES
from jobplane.errors import UnavailableError
from jobplane.store.factory import open_store
from jobplane.store.sql import SqlStore
from jobplane.store.tables import job_definitions, job_instances
from tests.chaos.checker import Findings, check, read_runs
from tests.chaos.cluster import Cluster
from tests.chaos.faults import FaultLog, Faults
from tests.chaos.load import Load
from tests.chaos.logscan import Scan
from tests.chaos.servers import Postgres, Redis
from tests.chaos.streams import StreamWatch
from tests.cli_helpers import run_cli

WORKERS = ("w1", "w2", "w3")
SCHEDULERS = ("s1", "s2")
#: Seconds the leader's definition cache has, once asked after the quiet period, to match the
#: store: its sweep checks every version against Postgres each 0.5 s (guarantee 6's backstop).
CONVERGE_S = 10.0


@dataclass
class Report:
    seed: int
    seconds: float
    findings: Findings
    faults: FaultLog
    ops: Counter[str]
    acknowledged: int
    runs_noted: int
    logs: Scan
    streams: StreamWatch
    drained_in_s: float | None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.findings.total == 0

    def render(self) -> str:
        lines = [f"chaos run: seed {self.seed}, {self.seconds:g} s of faults"]
        lines.append("faults: " + _counts(self.faults.kinds))
        lines += [
            f"  {at:7.1f} s  {kind} {detail}".rstrip() for at, kind, detail in self.faults.entries
        ]
        if self.faults.failovers:
            lines.append(f"leader failover after SIGKILL (s): {self.faults.failovers}")
        lines.append("requests: " + _counts(self.ops))
        lines.append(f"acknowledged instances: {self.acknowledged}")
        lines.append(f"attempts noted by the jobs (checked for overlaps): {self.runs_noted}")
        lines.append("instances by final state: " + _counts(self.findings.states))
        drained = "not drained" if self.drained_in_s is None else f"{self.drained_in_s:.1f} s"
        lines.append(f"quiet period drained in: {drained}")
        lines.append(f"runaways (slot held past their Failed step): {self.findings.runaways_held}")
        w = self.streams
        lines.append(
            f"stream samples: {w.samples} (skipped while a server was down: {w.skipped}); "
            f"most entries {w.max_entries}, most Enqueued {w.max_enqueued}, most entries of "
            f"instances no longer Enqueued {w.max_not_enqueued}"
        )
        lines.append(
            "errors the roles handled (by level and action): " + _counts(self.logs.handled)
        )
        lines += self.notes
        lines.append(f"violations: {self.findings.total}")
        for invariant, details in sorted(self.findings.violations.items()):
            lines.append(f"  {invariant}: {len(details)}")
            lines += [f"    {d}" for d in details[:10]]
        return "\n".join(lines)


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counter.items())) or "none"


class Harness:
    """``async with Harness() as h: report = await h.run(seconds, seed)``."""

    def __init__(self) -> None:
        self.pg = Postgres()
        self.redis = Redis()
        self.token = "jp_" + secrets.token_urlsafe(32)
        self._scratch = tempfile.TemporaryDirectory(prefix="jobplane-chaos-")
        self.runs = Path(self._scratch.name) / "runs"
        self.cluster = Cluster(self.pg, self.redis, self.token, self.runs)
        self.store: SqlStore | None = None
        self.streams_left: dict[str, int] = {}
        self.streams_seen = 0

    async def __aenter__(self) -> Harness:
        try:
            await asyncio.to_thread(self.pg.start)
            self.redis.start()
            migrated = await asyncio.to_thread(
                run_cli,
                "migrate",
                JOBPLANE_DATABASE_URL=self.pg.url,
                JOBPLANE_BOOTSTRAP_ADMIN_TOKEN=self.token,
            )
            if migrated.returncode != 0:
                raise RuntimeError(f"jobplane migrate failed: {migrated.stderr}")
            self.store = open_store(self.pg.url, pool_size=2)
            roles = [await self.cluster.add("api", "api")]
            roles += [await self.cluster.add(name, "scheduler") for name in SCHEDULERS]
            roles += [await self.cluster.add(name, "worker") for name in WORKERS]
            await asyncio.gather(*(self.cluster.start(r) for r in roles))
        except BaseException:
            await self._teardown()
            raise
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._teardown()

    async def _teardown(self) -> None:
        await self.cluster.close()
        if self.store is not None:
            await self.store.close()
        await asyncio.to_thread(self.redis.stop)
        await asyncio.to_thread(self.pg.stop)
        self._scratch.cleanup()

    @property
    def db(self) -> SqlStore:
        assert self.store is not None, "use the harness as an async context manager"
        return self.store

    async def run(
        self,
        seconds: float,
        seed: int,
        *,
        rate_per_s: float = 6.0,
        fault_every_s: tuple[float, float] = (3.0, 6.0),
        quiet_s: float = 90.0,
    ) -> Report:
        rng = random.Random(seed)
        api = self.cluster.roles["api"]
        load = Load(
            f"http://127.0.0.1:{api.port}",
            self.token,
            list(WORKERS),
            random.Random(rng.random()),
            rate_per_s,
        )
        faults = Faults(self.cluster, self.db, random.Random(rng.random()))
        stop_load, stop_faults, stop_sampling = asyncio.Event(), asyncio.Event(), asyncio.Event()
        watching = asyncio.create_task(self._watch())
        streams = StreamWatch(self.redis.port, self.db, self.cluster.up_for)
        sampling = asyncio.create_task(streams.run(stop_sampling))
        loading = asyncio.create_task(load.run(stop_load))
        await asyncio.sleep(2)  # some work in flight before the first fault
        faulting = asyncio.create_task(faults.run(stop_faults, fault_every_s))
        await asyncio.sleep(seconds)
        stop_faults.set()
        await faulting
        stop_load.set()
        await loading
        stop_sampling.set()
        await sampling
        drained, diverged = await self._quiet(quiet_s)
        watching.cancel()
        self.cluster.check_alive()
        runs = read_runs(self.runs)
        findings = await check(self.db, load.acks, runs=runs, frozen=faults.log.frozen)
        for gone in self.cluster.unexpected:
            findings.add("unexpected_exit", f"{gone.role} (status {gone.status}): {gone.tail}")
        logs = self.cluster.scan_logs()
        for crash in logs.crashes:
            findings.add("crash_in_log", crash)
        for invariant, detail in streams.violations:
            findings.add(invariant, detail)
        for detail in diverged:
            findings.add("definitions_not_converged", detail)
        for key, n in self.streams_left.items():
            findings.add("stream_entries_left", f"{key}: {n} entries, nothing Enqueued")
        for broken in load.violations:
            findings.add("idempotency_answer", broken)
        for at, kind, detail in faults.log.entries:
            if kind == "harness_error":
                findings.add("harness_error", f"at {at} s: {detail}")
        notes = [f"Redis streams checked for entries left over: {self.streams_seen}"]
        return Report(
            seed,
            seconds,
            findings,
            faults.log,
            load.ops,
            len(load.acks),
            len(runs),
            logs,
            streams,
            drained,
            notes,
        )

    async def _watch(self) -> None:
        while True:
            self.cluster.check_alive()
            await asyncio.sleep(0.5)

    async def _quiet(self, quiet_s: float) -> tuple[float | None, list[str]]:
        """Let everything finish: first what was made before the load stopped (schedulers
        still running: delays, reaping, ticks), then check that the leader's definition cache
        matches the store, then — schedulers stopped — let the last ticks finish. Then note the
        stream entries left over, and stop every role with SIGTERM. The seconds it took (or
        ``None`` if it never did), and how the cache differed from the store."""
        began = time.monotonic()
        since = await self._db_now()
        done = await self._settled(since, quiet_s)
        diverged = await self._converged(CONVERGE_S)
        schedulers = [self.cluster.roles[name] for name in SCHEDULERS]
        await asyncio.gather(*(self.cluster.stop(r, signal.SIGTERM) for r in schedulers))
        done = await self._settled(None, 30) and done
        took = time.monotonic() - began
        if done:
            self.streams_left = await self._streams_left(15)
        running = [r for r in self.cluster.roles.values() if r.running]
        await asyncio.gather(*(self.cluster.stop(r, signal.SIGTERM) for r in running))
        return (took if done else None), diverged

    async def _converged(self, timeout_s: float) -> list[str]:
        """Guarantee 6: every cache of definitions converges on the store. The leader holds
        the only one (workers read a job's options with each claim; the api and a follower
        read the store): ask its probe server's ``/definitions`` until it matches the store's
        (version, paused) of every job, for ``timeout_s``. The differences left, if any."""
        d = job_definitions.c
        async with self.db.engine.connect() as conn:
            rows = await conn.execute(select(d.key, d.version, d.paused))
            stored = {key: {"version": v, "paused": p} for key, v, p in rows}
        deadline = time.monotonic() + timeout_s
        differences = ["no scheduler answered as the leader"]
        async with httpx.AsyncClient(timeout=2) as client:
            while time.monotonic() < deadline:
                differences = await self._cache_differences(client, stored)
                if not differences:
                    return []
                await asyncio.sleep(0.5)
        return differences

    async def _cache_differences(
        self, client: httpx.AsyncClient, stored: dict[str, dict[str, object]]
    ) -> list[str]:
        try:
            lease = await self.db.get_leader(0)
        except UnavailableError as error:
            return [f"the store did not answer: {error}"]
        role = self.cluster.roles.get(lease.holder) if lease is not None else None
        if role is None or not role.running:
            return ["no scheduler answered as the leader"]
        try:
            answer = (await client.get(f"http://127.0.0.1:{role.port}/definitions")).json()
        except httpx.HTTPError as error:
            return [f"{role.name}: /definitions did not answer: {error!r}"]
        cached = answer["definitions"]
        if cached is None:
            return [f"{role.name} holds the lease but does not lead yet"]
        return [
            f"{role.name}: {key} cached as {cached.get(key)}, stored as {stored.get(key)}"
            for key in sorted(set(stored) | set(cached))
            if cached.get(key) != stored.get(key)
        ]

    async def _streams_left(self, timeout_s: float) -> dict[str, int]:
        """With nothing Enqueued any more, every stream entry must have been consumed (acked
        and deleted, or dropped): the entries still there after ``timeout_s``, by stream."""
        client = aioredis.Redis(port=self.redis.port, decode_responses=True)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                left = {}
                self.streams_seen = 0
                async for key in client.scan_iter(match="chaos:*", _type="stream"):
                    self.streams_seen += 1
                    if n := await client.xlen(key):
                        left[key] = n
                if not left or time.monotonic() > deadline:
                    return left
                await asyncio.sleep(0.5)
        finally:
            await client.aclose()

    async def _db_now(self) -> datetime:
        async with self.db.engine.connect() as conn:
            now = await conn.scalar(select(func.now()))
        assert isinstance(now, datetime)
        return now

    async def _settled(self, created_before: datetime | None, timeout_s: float) -> bool:
        """Wait until no instance (made before ``created_before``) is unfinished."""
        i = job_instances.c
        query = select(func.count()).where(i.state.not_in([s.value for s in TERMINAL_STATES]))
        if created_before is not None:
            query = query.where(i.created_at < created_before)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            async with self.db.engine.connect() as conn:
                if await conn.scalar(query) == 0:
                    return True
            await asyncio.sleep(0.5)
        return False
