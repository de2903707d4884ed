"""Celery with its Redis broker and no result backend: two ``celery worker --pool solo``
processes (one job at a time each, Celery's default prefetch of 4)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path

from celery import Celery

from bench.peers.adapters import harness, probe

app = Celery("peers", broker=os.environ.get("PEERS_REDIS_URL"))
app.conf.update(task_ignore_result=True, broker_connection_retry_on_startup=True)


@app.task(name="noop")
def noop(sent: float) -> None:
    probe.record(sent)


class Client:
    label = ""
    in_flight = None
    has_bulk = False

    async def single(self, sent: float) -> None:
        noop.delay(sent)

    async def bulk(self, count: int) -> None:
        raise NotImplementedError


class System:
    name = "Celery"
    version = version("celery")
    keeps = "nothing (no result backend)"
    notes: Sequence[str] = ("2 x `celery worker --pool solo`, default prefetch",)

    async def setup(self, config: harness.Config) -> Sequence[harness.Client]:
        return [Client()]

    def worker_commands(self, config: harness.Config) -> list[list[str]]:
        celery = str(Path(sys.executable).parent / "celery")
        common = [celery, "-A", "bench.peers.adapters.celery", "worker", "--pool", "solo"]
        return [[*common, "-n", f"peers{i}@%h", "--loglevel", "WARNING"] for i in range(2)]

    def worker_env(self, config: harness.Config) -> dict[str, str]:
        return {}

    async def teardown(self) -> None:
        app.close()
