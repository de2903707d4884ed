"""taskiq with taskiq-redis's ``RedisStreamBroker`` (acknowledged Redis Streams) and no result
backend: ``taskiq worker --workers 2`` (two worker processes under taskiq's supervisor)."""

from __future__ import annotations

from collections.abc import Sequence
from importlib.metadata import version

from taskiq_redis import RedisStreamBroker

from bench.peers.adapters import harness, probe

broker = RedisStreamBroker(url=harness.redis_url())


@broker.task(task_name="noop")
async def noop(sent: float) -> None:
    probe.record(sent)


class Client(harness.SingleCalls):
    async def single(self, sent: float) -> None:
        await noop.kiq(sent)


class System(harness.NoWorkerEnv):
    name = "taskiq"
    version = f"{version('taskiq')} (taskiq-redis {version('taskiq-redis')}, Streams)"
    keeps = "nothing (no result backend)"
    notes: Sequence[str] = ()

    async def setup(self, config: harness.Config) -> Sequence[harness.Client]:
        await broker.startup()
        return [Client()]

    def worker_commands(self, config: harness.Config) -> list[list[str]]:
        command = [harness.installed("taskiq"), "worker"]
        command += ["bench.peers.adapters.taskiq:broker", "--workers", "2"]
        command += ["--max-async-tasks", str(config.concurrency), "--log-level", "WARNING"]
        return [command]

    async def teardown(self) -> None:
        await broker.shutdown()
