"""saq on Redis: two ``saq`` worker processes; each job's record (status, result) stays in
Redis for 10 minutes (saq's default TTL) after it ran."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

from saq import Queue

from bench.peers.adapters import harness, probe

queue = Queue.from_url(os.environ.get("PEERS_REDIS_URL", "redis://127.0.0.1:1"))


async def noop(ctx: Any, *, sent: float) -> None:
    probe.record(sent)


settings = {
    "queue": queue,
    "functions": [noop],
    "concurrency": int(os.environ.get("PEERS_CONCURRENCY", "10")),
}


class Client:
    label = ""
    in_flight = None
    has_bulk = False

    async def single(self, sent: float) -> None:
        await queue.enqueue("noop", sent=sent)

    async def bulk(self, count: int) -> None:
        raise NotImplementedError


class System:
    name = "saq"
    version = version("saq")
    keeps = "each job's last state, in Redis, for 10 minutes"
    notes: Sequence[str] = ()

    async def setup(self, config: harness.Config) -> Sequence[harness.Client]:
        await queue.connect()
        return [Client()]

    def worker_commands(self, config: harness.Config) -> list[list[str]]:
        command = [str(Path(sys.executable).parent / "saq"), "bench.peers.adapters.saq.settings"]
        return [command, command]

    def worker_env(self, config: harness.Config) -> dict[str, str]:
        return {"PEERS_CONCURRENCY": str(config.concurrency)}

    async def teardown(self) -> None:
        await queue.disconnect()
