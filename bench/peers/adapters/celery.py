"""Celery with its Redis broker and no result backend: two ``celery worker --pool solo``
processes (one job at a time each, Celery's default prefetch of 4)."""

from __future__ import annotations

from collections.abc import Sequence
from importlib.metadata import version

from celery import Celery

from bench.peers.adapters import harness, probe

app = Celery("peers", broker=harness.redis_url())
app.conf.update(task_ignore_result=True, broker_connection_retry_on_startup=True)


@app.task(name="noop")
def noop(sent: float) -> None:
    probe.record(sent)


class Client(harness.SingleCalls):
    async def single(self, sent: float) -> None:
        noop.delay(sent)


class System(harness.NoWorkerEnv):
    name = "Celery"
    version = version("celery")
    keeps = "nothing (no result backend)"
    notes: Sequence[str] = ("2 x `celery worker --pool solo`, default prefetch",)

    async def setup(self, config: harness.Config) -> Sequence[harness.Client]:
        return [Client()]

    def worker_commands(self, config: harness.Config) -> list[list[str]]:
        common = [harness.installed("celery"), "-A", "bench.peers.adapters.celery"]
        common += ["worker", "--pool", "solo"]
        return [[*common, "-n", f"peers{i}@%h", "--loglevel", "WARNING"] for i in range(2)]

    async def teardown(self) -> None:
        app.close()
