"""Jobplane in the peers' harness (the project's own environment): two ``jobplane worker``
processes on a fresh Postgres database and the run's Redis; enqueued through the Python API
(``Dispatcher.trigger`` / ``trigger_many``) and over REST through a real ``jobplane api``
process (``POST /api/v1/jobs/noop/instances`` / ``POST /api/v1/instances/batch``). The job is
in :mod:`bench.peers.adapters.jobplane_jobs`, the module the workers import."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AsyncExitStack
from importlib.metadata import version

import httpx

from bench.api import BATCH_PATH, TRIGGER_PATH, api_process
from bench.common import bus_for, environment
from bench.peers.adapters import harness
from bench.peers.adapters.jobplane_jobs import Sent
from jobplane.dispatch import Dispatcher
from jobplane.domain.models import NewInstance
from jobplane.domain.options import JobOptions


class PythonClient:
    label = "Python API"
    in_flight = None
    has_bulk = True

    def __init__(self, dispatcher: Dispatcher) -> None:
        self._dispatcher = dispatcher

    async def single(self, sent: float) -> None:
        await self._dispatcher.trigger("noop", {"t": sent})

    async def bulk(self, count: int) -> None:
        await self._dispatcher.trigger_many(
            [NewInstance(job_key="noop", args={"t": 0.0}) for _ in range(count)]
        )


class RestClient:
    label = "REST, `jobplane api`"
    in_flight = 16
    has_bulk = True

    def __init__(self, http: httpx.AsyncClient) -> None:
        self._http = http

    async def single(self, sent: float) -> None:
        (await self._http.post(TRIGGER_PATH, json={"args": {"t": sent}})).raise_for_status()

    async def bulk(self, count: int) -> None:
        items = [{"job_key": "noop", "args": {"t": 0.0}} for _ in range(count)]
        (await self._http.post(BATCH_PATH, json={"items": items})).raise_for_status()


class System:
    name = "Jobplane"
    version = version("jobplane")
    keeps = "every transition, in Postgres"
    notes: Sequence[str] = ()

    def __init__(self) -> None:
        self._stack = AsyncExitStack()
        self._url = ""
        self._prefix = ""

    async def setup(self, config: harness.Config) -> Sequence[harness.Client]:
        self._url, self._prefix, store = await self._stack.enter_async_context(environment())
        options = JobOptions.parse(key="noop", kind="triggered", max_concurrency=1_000_000)
        await store.register_definition(options, Sent.model_json_schema(), "bench")
        bus = bus_for(self._prefix)
        self._stack.push_async_callback(bus.close)
        base = await self._stack.enter_async_context(api_process(self._url, self._prefix))
        limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
        http = httpx.AsyncClient(base_url=base, limits=limits, timeout=60)
        await self._stack.enter_async_context(http)
        dispatcher = await self._stack.enter_async_context(Dispatcher(store, bus))
        return [PythonClient(dispatcher), RestClient(http)]

    def worker_commands(self, config: harness.Config) -> list[list[str]]:
        common = [harness.installed("jobplane"), "worker"]
        common += ["--app", "bench.peers.adapters.jobplane_jobs:app"]
        common += ["--concurrency", str(config.concurrency)]
        return [[*common, "--worker-id", f"peers-{i}"] for i in range(2)]

    def worker_env(self, config: harness.Config) -> dict[str, str]:
        return {
            "JOBPLANE_DATABASE_URL": self._url,
            "JOBPLANE_REDIS_URL": config.redis_url,
            "JOBPLANE_KEY_PREFIX": self._prefix,
            "JOBPLANE_LOG_LEVEL": "WARNING",
        }

    async def teardown(self) -> None:
        await self._stack.aclose()
