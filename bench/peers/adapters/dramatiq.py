"""Dramatiq with its Redis broker: one ``dramatiq`` command with 2 worker processes of 8
threads each (its defaults), under Dramatiq's supervisor process."""

from __future__ import annotations

from collections.abc import Sequence
from importlib.metadata import version

import dramatiq
from dramatiq.brokers.redis import RedisBroker

from bench.peers.adapters import harness, probe

broker = RedisBroker(url=harness.redis_url())
dramatiq.set_broker(broker)


@dramatiq.actor(max_retries=0)
def noop(sent: float) -> None:
    probe.record(sent)


class Client(harness.SingleCalls):
    async def single(self, sent: float) -> None:
        noop.send(sent)


class System(harness.NoWorkerEnv):
    name = "Dramatiq"
    version = version("dramatiq")
    keeps = "nothing"
    notes: Sequence[str] = ("`dramatiq --processes 2 --threads 8` (the defaults)",)

    async def setup(self, config: harness.Config) -> Sequence[harness.Client]:
        return [Client()]

    def worker_commands(self, config: harness.Config) -> list[list[str]]:
        return [
            [
                harness.installed("dramatiq"),
                "bench.peers.adapters.dramatiq",
                "--processes",
                "2",
                "--threads",
                "8",
            ]
        ]

    async def teardown(self) -> None:
        broker.close()
