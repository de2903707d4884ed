"""Dramatiq with its Redis broker: one ``dramatiq`` command with 2 worker processes of 8
threads each (its defaults), under Dramatiq's supervisor process."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path

import dramatiq
from dramatiq.brokers.redis import RedisBroker

from bench.peers.adapters import harness, probe

broker = RedisBroker(url=os.environ.get("PEERS_REDIS_URL"))
dramatiq.set_broker(broker)


@dramatiq.actor(max_retries=0)
def noop(sent: float) -> None:
    probe.record(sent)


class Client:
    label = ""
    in_flight = None
    has_bulk = False

    async def single(self, sent: float) -> None:
        noop.send(sent)

    async def bulk(self, count: int) -> None:
        raise NotImplementedError


class System:
    name = "Dramatiq"
    version = version("dramatiq")
    keeps = "nothing"
    notes: Sequence[str] = ("`dramatiq --processes 2 --threads 8` (the defaults)",)

    async def setup(self, config: harness.Config) -> Sequence[harness.Client]:
        return [Client()]

    def worker_commands(self, config: harness.Config) -> list[list[str]]:
        command = str(Path(sys.executable).parent / "dramatiq")
        return [[command, "bench.peers.adapters.dramatiq", "--processes", "2", "--threads", "8"]]

    def worker_env(self, config: harness.Config) -> dict[str, str]:
        return {}

    async def teardown(self) -> None:
        broker.close()
