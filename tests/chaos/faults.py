"""Faults drawn from a seed, started one after another and overlapping: each runs as its own
task, takes the role it acts on (no second fault takes a busy role) and puts it back."""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from jobplane.errors import StoreUnavailableError
from jobplane.store.sql import SqlStore
from tests.chaos.cluster import Cluster, Role

#: Seconds a frozen role stays frozen: past a worker's lease (2 s) and the leader's TTL (2 s).
FREEZE_S = (3.5, 6.0)
#: Seconds a partition lasts.
PARTITION_S = (3.0, 7.0)


#: Every kind of fault (each a method of :class:`Faults`).
KINDS = (
    "sigkill_worker",
    "sigkill_leader",
    "sigterm_role",
    "sigstop_worker",
    "sigstop_leader",
    "redis_restart_empty",
    "redis_client_kill",
    "postgres_restart",
    "partition_worker",
    "partition_leader",
    "postgres_latency",
)
#: Seconds a fault waits for a free role to act on before giving up.
TARGET_WAIT_S = 10.0


@dataclass
class FaultLog:
    began: float
    #: (seconds since the start, kind, detail), in order of start.
    entries: list[tuple[float, str, str]] = field(default_factory=list)
    kinds: Counter[str] = field(default_factory=Counter)
    #: Seconds from a leader's loss to another scheduler leading.
    failovers: list[float] = field(default_factory=list)
    #: (role, from, to) on the wall clock: when a role was stopped with SIGSTOP.
    frozen: list[tuple[str, float, float]] = field(default_factory=list)

    def note(self, kind: str, detail: str) -> None:
        self.kinds[kind] += 1
        self.entries.append((round(time.monotonic() - self.began, 1), kind, detail))


class Faults:
    def __init__(self, cluster: Cluster, store: SqlStore, rng: random.Random) -> None:
        self.cluster = cluster
        self.store = store
        self.rng = rng
        self.log = FaultLog(time.monotonic())
        self._tasks: set[asyncio.Task[None]] = set()
        self._server_lock = asyncio.Lock()
        self.kinds: dict[str, Callable[[], Awaitable[None]]] = {
            kind: getattr(self, kind) for kind in KINDS
        }

    async def run(self, stop: asyncio.Event, interval_s: tuple[float, float]) -> None:
        """Start a fault every ``interval_s`` seconds until ``stop``: every kind once (in a
        seeded order) first, then kinds at random. Then wait for the running ones to end."""
        order = list(self.kinds)
        self.rng.shuffle(order)
        while not stop.is_set():
            kind = order.pop(0) if order else self.rng.choice(list(self.kinds))
            task = asyncio.create_task(self._guarded(kind))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.rng.uniform(*interval_s))
        await asyncio.gather(*self._tasks)

    async def _guarded(self, kind: str) -> None:
        """Run a fault; one the harness fails to carry out (a role that does not come back,
        the harness's own connection lost) is logged as ``harness_error``, not raised."""
        try:
            await self.kinds[kind]()
        except Exception as error:
            self.log.note("harness_error", f"{kind}: {error!r}")

    def _free(self, kind: str) -> Callable[[], Awaitable[Role | None]]:
        async def find() -> Role | None:
            free = [r for r in self.cluster.of_kind(kind) if not r.busy and r.running]
            return self.rng.choice(free) if free else None

        return find

    async def _leader(self) -> Role | None:
        try:
            lease = await self.store.get_leader(0)
        except StoreUnavailableError:
            return None  # Postgres restarting: ask again
        role = self.cluster.roles.get(lease.holder) if lease is not None else None
        return role if role is not None and not role.busy and role.running else None

    async def _restart_after(self, role: Role, sig: signal.Signals, pause_s: float) -> None:
        await self.cluster.stop(role, sig)
        await asyncio.sleep(pause_s)
        await self.cluster.start(role)

    async def _hold(
        self,
        find: Callable[[], Awaitable[Role | None]],
        kind: str,
        act: Callable[[Role], Awaitable[None]],
    ) -> None:
        """Take a free role ``find`` names (waiting for one a while), act on it, free it."""
        deadline = time.monotonic() + TARGET_WAIT_S
        while (role := await find()) is None:
            if time.monotonic() > deadline:
                self.log.note(f"{kind}:no_target", "")
                return
            await asyncio.sleep(0.5)
        role.busy = True
        try:
            self.log.note(kind, role.name)
            await act(role)
        finally:
            role.busy = False

    async def sigkill_worker(self) -> None:
        await self._hold(
            self._free("worker"),
            "sigkill_worker",
            lambda r: self._restart_after(r, signal.SIGKILL, self.rng.uniform(0.5, 3)),
        )

    async def sigkill_leader(self) -> None:
        await self._hold(self._leader, "sigkill_leader", self._kill_leader)

    async def _kill_leader(self, role: Role) -> None:
        lost = time.monotonic()
        await self.cluster.stop(role, signal.SIGKILL)
        await self._time_failover(role.name, lost)
        await self.cluster.start(role)

    async def _time_failover(self, old: str, since: float) -> None:
        while time.monotonic() - since < 30:
            with contextlib.suppress(StoreUnavailableError):
                lease = await self.store.get_leader(0)
                if lease is not None and lease.holder != old:
                    self.log.failovers.append(round(time.monotonic() - since, 2))
                    return
            await asyncio.sleep(0.1)

    async def sigterm_role(self) -> None:
        kind = self.rng.choice(["api", "scheduler", "worker"])
        await self._hold(
            self._free(kind),
            "sigterm_role",
            lambda r: self._restart_after(r, signal.SIGTERM, self.rng.uniform(0.2, 1)),
        )

    async def _freeze(self, role: Role) -> None:
        began = time.time()
        self.cluster.send(role, signal.SIGSTOP)
        await asyncio.sleep(self.rng.uniform(*FREEZE_S))
        self.cluster.send(role, signal.SIGCONT)
        # Its code may run on a moment after it resumes, until the fence loop stops it.
        self.log.frozen.append((role.name, began, time.time() + 1))

    async def sigstop_worker(self) -> None:
        await self._hold(self._free("worker"), "sigstop_worker", self._freeze)

    async def sigstop_leader(self) -> None:
        await self._hold(self._leader, "sigstop_leader", self._freeze)

    async def redis_restart_empty(self) -> None:
        async with self._server_lock:
            self.log.note("redis_restart_empty", "")
            await asyncio.to_thread(self.cluster.redis.restart_empty)
            await asyncio.sleep(2)

    async def redis_client_kill(self) -> None:
        self.log.note("redis_client_kill", "")
        client = aioredis.Redis(port=self.cluster.redis.port, socket_timeout=5)
        try:
            await client.client_kill_filter(_type="normal", skipme=True)
        except (aioredis.RedisError, OSError) as error:
            self.log.note("redis_client_kill:failed", repr(error))
        finally:
            await client.aclose()

    async def postgres_restart(self) -> None:
        async with self._server_lock:
            self.log.note("postgres_restart", "")
            await asyncio.to_thread(self.cluster.pg.restart)
            await asyncio.sleep(2)

    async def _partition(self, role: Role) -> None:
        proxy = self.rng.choice([role.pg, role.redis])
        self.log.note("partition:" + ("postgres" if proxy is role.pg else "redis"), role.name)
        proxy.cut()
        await asyncio.sleep(self.rng.uniform(*PARTITION_S))
        proxy.heal()

    async def partition_worker(self) -> None:
        await self._hold(self._free("worker"), "partition_worker", self._partition)

    async def partition_leader(self) -> None:
        await self._hold(self._leader, "partition_leader", self._partition)

    async def postgres_latency(self) -> None:
        delay = round(self.rng.uniform(0.02, 0.15), 3)
        self.log.note("postgres_latency", f"{delay} s")
        pg_proxies = [r.pg for r in self.cluster.roles.values()]
        for proxy in pg_proxies:
            proxy.delay_s = delay
        await asyncio.sleep(self.rng.uniform(3, 6))
        for proxy in pg_proxies:
            proxy.delay_s = 0.0
