"""arq on Redis: two ``arq`` worker processes. arq polls its queue (a sorted set) every
``poll_delay`` (0.5 s by default, kept) and keeps each job's result in Redis for an hour."""

from __future__ import annotations

from collections.abc import Sequence
from importlib.metadata import version
from typing import Any

from arq import ArqRedis, create_pool
from arq.connections import RedisSettings

from bench.peers.adapters import harness, probe

REDIS = RedisSettings.from_dsn(harness.redis_url())


async def noop(ctx: Any, sent: float) -> None:
    probe.record(sent)


class WorkerSettings:
    functions = [noop]
    redis_settings = REDIS
    max_jobs = harness.worker_concurrency()


class Client(harness.SingleCalls):
    def __init__(self, pool: ArqRedis) -> None:
        self._pool = pool

    async def single(self, sent: float) -> None:
        await self._pool.enqueue_job("noop", sent)


class System:
    name = "arq"
    version = version("arq")
    keeps = "each job's result, in Redis, for an hour"
    notes: Sequence[str] = ("polls its queue every 0.5 s (`poll_delay`, default)",)

    def __init__(self) -> None:
        self._pool: ArqRedis | None = None

    async def setup(self, config: harness.Config) -> Sequence[harness.Client]:
        self._pool = await create_pool(REDIS)
        return [Client(self._pool)]

    def worker_commands(self, config: harness.Config) -> list[list[str]]:
        command = [harness.installed("arq"), "bench.peers.adapters.arq.WorkerSettings"]
        return [command, command]

    def worker_env(self, config: harness.Config) -> dict[str, str]:
        return harness.concurrency_env(config)

    async def teardown(self) -> None:
        if self._pool is not None:
            await self._pool.aclose()
