"""saq on Redis: two ``saq`` worker processes; each job's record (status, result) stays in
Redis for 10 minutes (saq's default TTL) after it ran."""

from __future__ import annotations

from collections.abc import Sequence
from importlib.metadata import version
from typing import Any

from saq import Queue

from bench.peers.adapters import harness, probe

queue = Queue.from_url(harness.redis_url())


async def noop(ctx: Any, *, sent: float) -> None:
    probe.record(sent)


settings = {
    "queue": queue,
    "functions": [noop],
    "concurrency": harness.worker_concurrency(),
}


class Client(harness.SingleCalls):
    async def single(self, sent: float) -> None:
        await queue.enqueue("noop", sent=sent)


class System:
    name = "saq"
    version = version("saq")
    keeps = "each job's last state, in Redis, for 10 minutes"
    notes: Sequence[str] = ()

    async def setup(self, config: harness.Config) -> Sequence[harness.Client]:
        await queue.connect()
        return [Client()]

    def worker_commands(self, config: harness.Config) -> list[list[str]]:
        command = [harness.installed("saq"), "bench.peers.adapters.saq.settings"]
        return [command, command]

    def worker_env(self, config: harness.Config) -> dict[str, str]:
        return harness.concurrency_env(config)

    async def teardown(self) -> None:
        await queue.disconnect()
