"""A local "cluster": the roles as real processes, started with the commands the image runs
(an api, two schedulers, three workers with their probe servers), on real Postgres and Redis,
driven over REST while workers are scaled 3 → 6 → 2 and every role is rolled one by one
(a new process started, then the old one stopped with SIGTERM, as a Deployment rolls with
maxSurge 1). Afterwards no instance is lost, duplicated, stuck or failed, and every stopped
process exited 0."""

from __future__ import annotations

import asyncio
import itertools
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from uuid import UUID

import httpx
import pytest

from jobplane.domain.models import InstanceFilter
from jobplane.domain.states import InstanceState as S
from jobplane.store.sql import SqlStore
from tests.cli_helpers import free_port, run_cli, spawn_cli, stop_all, wait_http_ok
from tests.worker_helpers import settled

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

APP = "tests.apps.basic:app"
JOB = "slow_echo"  # 0.3 s, max concurrency 100


@dataclass
class Cluster:
    env: dict[str, str]
    procs: list[subprocess.Popen[str]] = field(default_factory=list)
    names: itertools.count[int] = field(default_factory=itertools.count)

    def spawn(self, *args: str) -> tuple[subprocess.Popen[str], int]:
        """Start ``jobplane ARGS`` with a probe or API port of its own; return it and the port."""
        port = free_port()
        flag = "--port" if args[0] == "api" else "--health-port"
        extra = ["--host", "127.0.0.1"] if args[0] == "api" else []
        if args[0] == "worker":
            extra += ["--worker-id", f"w{next(self.names)}"]
        proc = spawn_cli(*args, *extra, flag, str(port), **self.env)
        self.procs.append(proc)
        return proc, port

    async def ready(self, port: int) -> None:
        await asyncio.to_thread(wait_http_ok, f"http://127.0.0.1:{port}/readyz", 60)

    async def start(self, *args: str) -> tuple[subprocess.Popen[str], int]:
        proc, port = self.spawn(*args)
        await self.ready(port)
        return proc, port


async def stop(*procs: subprocess.Popen[str]) -> list[int]:
    """SIGTERM, as an orchestrator stops a pod; the exit statuses."""
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    return [await asyncio.to_thread(p.wait, 60) for p in procs]


@pytest.fixture
def cluster(pg_database_url: str, redis_url: str, redis_prefix: str) -> Iterator[Cluster]:
    made = Cluster(
        {
            "JOBPLANE_DATABASE_URL": pg_database_url,
            "JOBPLANE_REDIS_URL": redis_url,
            "JOBPLANE_KEY_PREFIX": redis_prefix,
            "JOBPLANE_HEALTH_HOST": "127.0.0.1",
            "JOBPLANE_GRACE_S": "10",
            "JOBPLANE_LOG_FORMAT": "json",
        }
    )
    yield made
    stop_all(made.procs)


@dataclass
class Producer:
    """Triggers JOB over REST until stopped, each request with its own Idempotency-Key, so a
    request retried across an api's restart never creates a second instance."""

    token: str
    base: str
    ids: dict[str, UUID] = field(default_factory=dict)
    retries: int = 0

    async def run(self, stop: asyncio.Event) -> None:
        headers = {"Authorization": f"Bearer {self.token}"}
        async with httpx.AsyncClient(headers=headers, timeout=10) as client:
            for n in itertools.count():
                if stop.is_set():
                    return
                key = f"rollout-{n}"
                self.ids[key] = await self._trigger(client, key, n)
                await asyncio.sleep(0.02)

    async def _trigger(self, client: httpx.AsyncClient, key: str, n: int) -> UUID:
        while True:
            try:
                answer = await client.post(
                    f"{self.base}/api/v1/jobs/{JOB}/instances",
                    json={"args": {"value": n}},
                    headers={"Idempotency-Key": key},
                )
            except httpx.TransportError:
                self.retries += 1
                await asyncio.sleep(0.05)
                continue
            assert answer.status_code == 201, answer.text
            return UUID(answer.json()["id"])


async def test_scaling_and_rolling_every_role_loses_and_fails_nothing(
    cluster: Cluster, pg_store: SqlStore
) -> None:
    token = "jp_" + secrets.token_urlsafe(32)
    migrated = await asyncio.to_thread(
        run_cli, "migrate", env=cluster.env, JOBPLANE_BOOTSTRAP_ADMIN_TOKEN=token
    )
    assert migrated.returncode == 0, migrated.stderr
    began = time.monotonic()
    api, api_port = await cluster.start("api")
    schedulers = [await cluster.start("scheduler") for _ in range(2)]
    workers = [await cluster.start("worker", "--app", APP) for _ in range(3)]
    producer = Producer(token, f"http://127.0.0.1:{api_port}")
    stop_producing = asyncio.Event()
    producing = asyncio.create_task(producer.run(stop_producing))
    statuses: list[int] = []
    steps: list[tuple[str, float]] = []

    def step(name: str) -> None:
        steps.append((name, round(time.monotonic() - began, 1)))

    await asyncio.sleep(2)
    # Scale 3 → 6 → 2 while jobs run.
    workers += [await cluster.start("worker", "--app", APP) for _ in range(3)]
    step("6 workers")
    await asyncio.sleep(2)
    statuses += await stop(*[proc for proc, _ in workers[:4]])
    workers = workers[4:]
    step("2 workers")
    # Roll the schedulers, then the api, then the workers: new one up, old one stopped.
    for old, _ in list(schedulers):
        await cluster.start("scheduler")
        statuses += await stop(old)
    step("schedulers rolled")
    new_api, new_port = await cluster.start("api")
    producer.base = f"http://127.0.0.1:{new_port}"
    statuses += await stop(api)
    step("api rolled")
    for old, _ in list(workers):
        await cluster.start("worker", "--app", APP)
        statuses += await stop(old)
    step("workers rolled")
    await asyncio.sleep(1)
    stop_producing.set()
    await producing

    ids = list(producer.ids.values())
    done = await settled(pg_store, ids, timeout_s=90)
    elapsed = time.monotonic() - began
    assert statuses == [0] * 9  # 4 scaled down; 2 schedulers, the api, 2 workers rolled
    assert len(set(ids)) == len(ids)  # a retried request returned its first instance
    assert {i.state for i in done} == {S.SUCCEEDED}  # none lost, stuck, failed or terminated
    assert sorted(i.result for i in done) == list(range(len(ids)))
    stored = await pg_store.list_instances(InstanceFilter(job_key=JOB), limit=100_000)
    assert len(stored.items) == len(ids)  # nothing created twice
    released = 0
    for instance in done:
        moves = [(t.from_state, t.to_state) for t in await pg_store.transitions(instance.id)]
        released += moves.count((S.PROCESSING, S.ENQUEUED))
        assert moves[-1] == (S.PROCESSING, S.SUCCEEDED)
    sys.stderr.write(
        f"cluster rollout: {len(ids)} instances over REST in {elapsed:.1f} s, all succeeded; "
        f"{released} released by a stopping worker and run again; {producer.retries} "
        f"request(s) retried across the api's restart; steps {steps}\n"
    )
    assert new_api.poll() is None
