"""taskiq with taskiq-redis's ``RedisStreamBroker`` (acknowledged Redis Streams) and no result
backend: ``taskiq worker --workers 2`` (two worker processes under taskiq's supervisor)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path

from taskiq_redis import RedisStreamBroker

from bench.peers.adapters import harness, probe

broker = RedisStreamBroker(url=os.environ.get("PEERS_REDIS_URL", "redis://127.0.0.1:1"))


@broker.task(task_name="noop")
async def noop(sent: float) -> None:
    probe.record(sent)


class Client:
    label = ""
    in_flight = None
    has_bulk = False

    async def single(self, sent: float) -> None:
        await noop.kiq(sent)

    async def bulk(self, count: int) -> None:
        raise NotImplementedError


class System:
    name = "taskiq"
    version = f"{version('taskiq')} (taskiq-redis {version('taskiq-redis')}, Streams)"
    keeps = "nothing (no result backend)"
    notes: Sequence[str] = ()

    async def setup(self, config: harness.Config) -> Sequence[harness.Client]:
        await broker.startup()
        return [Client()]

    def worker_commands(self, config: harness.Config) -> list[list[str]]:
        command = [str(Path(sys.executable).parent / "taskiq"), "worker"]
        command += ["bench.peers.adapters.taskiq:broker", "--workers", "2"]
        command += ["--max-async-tasks", str(config.concurrency), "--log-level", "WARNING"]
        return [command]

    def worker_env(self, config: harness.Config) -> dict[str, str]:
        return {}

    async def teardown(self) -> None:
        await broker.shutdown()
