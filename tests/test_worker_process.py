"""The worker as a real process: graceful stop on SIGTERM, Postgres + Redis."""

from __future__ import annotations

import asyncio
import gc
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from subprocess import Popen
from typing import Protocol
from uuid import UUID

import httpx
import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from jobplane.bus.abc import Bus
from jobplane.dispatch import Dispatcher
from jobplane.domain.states import InstanceState as S
from jobplane.startup import freeze_startup_heap
from jobplane.store.sql import SqlStore
from tests.cli_helpers import free_port, output_of, spawn_cli, stop_all, wait_http_ok
from tests.store_helpers import slots_used
from tests.worker_helpers import settled, wait_for

pytestmark = [pytest.mark.long, pytest.mark.timeout(180)]


class SpawnWorker(Protocol):
    """Start ``jobplane worker`` with this id, these extra arguments and environment."""

    def __call__(self, worker_id: str, *extra: str, **env: str) -> Popen[str]: ...


@pytest.fixture
def spawn_worker(
    pg_database_url: str, redis_url: str, redis_prefix: str, tmp_path: Path
) -> Iterator[SpawnWorker]:
    procs: list[Popen[str]] = []

    def spawn(worker_id: str, *extra: str, **env: str) -> Popen[str]:
        proc = spawn_cli(
            "worker",
            "--app",
            "tests.apps.basic:app",
            "--worker-id",
            worker_id,
            *extra,
            **{
                "JOBPLANE_DATABASE_URL": pg_database_url,
                "JOBPLANE_REDIS_URL": redis_url,
                "JOBPLANE_KEY_PREFIX": redis_prefix,
                "JOBPLANE_HEARTBEAT_S": "0.2",
                "JOBPLANE_POLL_MS": "100",
                "JOBPLANE_TEST_MARKER": str(tmp_path / "started"),
                **env,
            },
        )
        procs.append(proc)
        return proc

    yield spawn
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        if proc.stdout:
            proc.stdout.close()


async def _migrated(store: SqlStore) -> None:
    from jobplane.store.schema import current_revision, head_revision

    assert await current_revision(store.engine) == head_revision()


async def test_worker_process_runs_jobs_and_stops_cleanly_on_sigterm(
    pg_store: SqlStore, redis_bus: Bus, spawn_worker: SpawnWorker
) -> None:
    await _migrated(pg_store)
    proc = spawn_worker("proc-1")
    await wait_for(lambda: _has_definitions(pg_store), what="job registration", timeout_s=30)
    dispatcher = Dispatcher(pg_store, redis_bus)
    made = [await dispatcher.trigger("echo", {"value": i}) for i in range(20)]
    made += [await dispatcher.trigger("add_sync", {"value": i}) for i in range(5)]
    done = await settled(pg_store, [i.id for i in made], timeout_s=60)
    assert {i.state for i in done} == {S.SUCCEEDED}
    assert {i.worker_id for i in done} == {"proc-1"}
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    [worker] = await pg_store.list_workers()
    assert worker.stopped_at is not None


async def test_sigterm_mid_job_releases_it_for_another_worker(
    pg_store: SqlStore, redis_bus: Bus, spawn_worker: SpawnWorker, tmp_path: Path
) -> None:
    first = spawn_worker("first", "--grace", "0.5", JOBPLANE_TEST_SLEEP_S="30")
    await wait_for(lambda: _has_definitions(pg_store), what="job registration", timeout_s=30)
    instance = await Dispatcher(pg_store, redis_bus).trigger("sleepy")
    marker = tmp_path / "started"
    await wait_for(lambda: _exists(marker), what="the job to start", timeout_s=30)
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=30) == 0
    released = await pg_store.get_instance(instance.id)
    assert released.state is S.ENQUEUED and released.retries_used == 0
    spawn_worker("second", JOBPLANE_TEST_SLEEP_S="0.1")
    [done] = await settled(pg_store, [instance.id], timeout_s=60)
    assert done.state is S.SUCCEEDED and done.worker_id == "second"
    assert done.retries_used == 0 and done.attempt == 2
    history = [(t.from_state, t.to_state, t.reason) for t in await pg_store.transitions(done.id)]
    assert (S.PROCESSING, S.ENQUEUED, "worker shutdown") in history
    assert not any(to is S.FAILED for _, to, _ in history)


async def test_health_port_serves_probes_and_reports_a_runaway(
    pg_store: SqlStore, redis_bus: Bus, spawn_worker: SpawnWorker, tmp_path: Path
) -> None:
    port = free_port()
    proc = spawn_worker(
        "probed",
        "--health-port",
        str(port),
        "--concurrency",
        "1",
        "--grace",
        "5",
        JOBPLANE_TIMEOUT_GRACE_S="0.2",
    )
    base = f"http://127.0.0.1:{port}"
    await asyncio.to_thread(wait_http_ok, f"{base}/readyz", 30)
    async with httpx.AsyncClient(base_url=base, timeout=5) as http:
        assert (await http.get("/healthz")).status_code == 200
        ready = (await http.get("/readyz")).json()
        assert ready["status"] == "ready"
        assert {name for name, check in ready["checks"].items() if check["ok"]} == {
            "postgres",
            "redis",
            "job_pool",
            "worker",
        }
        text = (await http.get("/metrics")).text
        for name in (
            "jobplane_worker_running_attempts",
            "jobplane_worker_attempts_finished_total",
            "jobplane_worker_claims_total",
            "jobplane_worker_runaway_jobs",
            "jobplane_worker_runaways_total",
            "jobplane_worker_lease_lost_writes_total",
        ):
            assert f"# TYPE {name.removesuffix('_total')}" in text, name

        # A sync job that ignores its 1 s timeout holds the only pool thread: not ready.
        gate = tmp_path / "gate"
        dispatcher = Dispatcher(pg_store, redis_bus)
        runaway = await dispatcher.trigger("ignores_timeout", {"path": str(gate)})
        await wait_for(lambda: _ready_is(http, False), what="/readyz to fail", timeout_s=30)
        body = (await http.get("/readyz")).json()
        assert body["checks"]["job_pool"]["ok"] is False
        assert "runaway" in body["checks"]["job_pool"]["detail"]
        assert body["checks"]["postgres"]["ok"] and body["checks"]["redis"]["ok"]
        figures = await _metrics(http)
        assert figures["jobplane_worker_runaway_jobs"] == 1
        assert figures["jobplane_worker_runaways_total"] == 1
        assert figures["jobplane_worker_running_attempts"] == 1

        # Its code returns: the thread is free again, and so is the worker.
        gate.touch()
        await wait_for(lambda: _ready_is(http, True), what="/readyz to recover", timeout_s=30)
        [done] = await settled(pg_store, [runaway.id], timeout_s=30)
        assert done.state is S.TERMINATED and done.error is not None
        assert done.error.type == "TimeoutError"
        figures = await _metrics(http)
        assert figures["jobplane_worker_runaway_jobs"] == 0
        assert figures["jobplane_worker_runaways_total"] == 1
        assert figures["jobplane_worker_claims_total"] == 1

        # While it drains on SIGTERM the worker is alive but not ready. (It drains until the
        # job it waits for returns: the test opens the gate once it has seen that.)
        drained = tmp_path / "drain-gate"
        await dispatcher.trigger("ignores_shutdown", {"path": str(drained)})
        await wait_for(lambda: _exists(tmp_path / "drain-gate.log"), what="the job to start")
        proc.send_signal(signal.SIGTERM)
        await wait_for(lambda: _ready_is(http, False), what="/readyz to fail on SIGTERM")
        body = (await http.get("/readyz")).json()
        assert body["checks"]["worker"] == {"ok": False, "detail": "shutting down"}
        assert (await http.get("/healthz")).status_code == 200
        assert proc.poll() is None
        drained.touch()
    assert await asyncio.to_thread(proc.wait, 30) == 0


async def _ready_is(http: httpx.AsyncClient, ready: bool) -> bool:
    status = (await http.get("/readyz")).status_code
    assert status in (200, 503)
    return (status == 200) is ready


async def _metrics(http: httpx.AsyncClient) -> dict[str, float]:
    """Each metric's samples summed over their labels (name → total)."""
    text = (await http.get("/metrics")).text
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


#: Imported by a worker only for what it is asked to do: the probe server (``--health-port``),
#: traces (``OTEL_EXPORTER_OTLP_ENDPOINT``), the HTTP client and the tables of the API commands,
#: arguments validated at a trigger, migrating (the schema check at start reads the revision
#: without Alembic); and never the API role.
OPTIONAL_PACKAGES = [
    "alembic",
    "fastapi",
    "starlette",
    "uvicorn",
    "httpx",
    "rich",
    "jsonschema",
    "opentelemetry.sdk.trace",
    "opentelemetry.exporter",
    "jobplane_api",
    "jobplane_worker.health",
    "jobplane.serving",
    # The embedded default's store: the worker here is on Postgres.
    "jobplane.store.sqlite",
    "sqlite3",
    # SQLAlchemy's ORM, and its asyncio extension, which imports it: the store runs Core on
    # an engine of its own (jobplane.store.engine).
    "sqlalchemy.orm",
    "sqlalchemy.ext.asyncio",
]
PROBE_PACKAGES = ["jobplane.serving", "jobplane_worker.health", "starlette", "uvicorn"]


@pytest.mark.parametrize("health", [False, True], ids=["plain", "health-port"])
async def test_a_worker_imports_optional_packages_only_when_it_uses_them(
    pg_store: SqlStore, redis_bus: Bus, spawn_worker: SpawnWorker, health: bool
) -> None:
    """An idle worker's memory is mostly the modules it imported: a plain worker (no probe
    port, no trace endpoint) never loads the optional ones, even while it runs a job; one with
    a probe port loads the probe server's (which shows the job below sees them when they are
    there)."""
    extra = ["--health-port", str(free_port())] if health else []
    spawn_worker("lean", *extra, OTEL_EXPORTER_OTLP_ENDPOINT="")
    await wait_for(lambda: _has_definitions(pg_store), what="job registration", timeout_s=30)
    made = await Dispatcher(pg_store, redis_bus).trigger(
        "loaded_packages", {"names": OPTIONAL_PACKAGES}
    )
    [done] = await settled(pg_store, [made.id], timeout_s=60)
    assert done.state is S.SUCCEEDED, done.error
    assert done.result == (sorted(PROBE_PACKAGES) if health else [])


async def test_a_worker_process_freezes_its_start_up_heap(
    pg_store: SqlStore, redis_bus: Bus, spawn_worker: SpawnWorker
) -> None:
    """The ``jobplane worker`` process moves what it holds once started out of the garbage
    collector's reach, so that a full collection does not pause its jobs to walk it; a role
    run inside another process (as the tests do) leaves that process's collector alone."""
    spawn_worker("frozen")
    await wait_for(lambda: _has_definitions(pg_store), what="job registration", timeout_s=30)
    made = await Dispatcher(pg_store, redis_bus).trigger("frozen_heap")
    [done] = await settled(pg_store, [made.id], timeout_s=60)
    assert done.state is S.SUCCEEDED, done.error
    assert done.result > 10_000  # the modules, the app, the store's and bus's machinery
    freeze_startup_heap()  # not asked for in this process: does nothing
    assert gc.get_freeze_count() == 0


async def test_sigterm_ends_a_blocking_read_at_once(
    pg_store: SqlStore, redis_url: str, spawn_worker: SpawnWorker
) -> None:
    poll_s = 30
    proc = spawn_worker("idle", JOBPLANE_POLL_MS=str(poll_s * 1000))
    await wait_for(lambda: _has_definitions(pg_store), what="job registration", timeout_s=30)
    await wait_for(lambda: _blocked_reader(redis_url), what="a blocking read", timeout_s=30)
    # The Redis client waits for the block's reply: against redis-py's 5 s read timeout, a
    # block longer than that was a Redis outage logged every poll.
    await asyncio.sleep(6)
    assert "Redis unavailable" not in output_of(proc)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(proc.wait, 30) == 0
    # Not once the read's 30 s block is over (a clean stop took over 3 s on a loaded machine).
    assert time.monotonic() - sent < 15
    [worker] = await pg_store.list_workers()
    assert worker.stopped_at is not None


async def _blocked_reader(redis_url: str) -> bool:
    """Some client of Redis is blocked in XREADGROUP (the worker's read, in this test)."""
    client = aioredis.from_url(redis_url)
    try:
        clients = await client.client_list()
    finally:
        await client.aclose()
    return any(c.get("cmd") == "xreadgroup" and "b" in c.get("flags", "") for c in clients)


async def _has_definitions(store: SqlStore) -> bool:
    """The worker registers its row after every job definition."""
    return len(await store.list_workers()) > 0


async def _exists(path: Path) -> bool:
    return await asyncio.to_thread(path.exists)


async def test_sigterm_waits_for_a_sync_job_that_ignores_it_and_releases_it_after(
    pg_store: SqlStore, redis_bus: Bus, spawn_worker: SpawnWorker, tmp_path: Path
) -> None:
    """A thread cannot be stopped: after --grace the attempt stays Processing on its worker
    (lease renewed) while its code runs, so a second worker never starts it meanwhile; once
    the code returns it is released, the second worker runs it, and the first exits 0."""
    fast = {"JOBPLANE_LEASE_S": "1.5"}
    first = spawn_worker("first", "--grace", "0.5", **fast)
    await wait_for(lambda: _has_definitions(pg_store), what="job registration", timeout_s=30)
    gate = tmp_path / "gate"
    log = tmp_path / "gate.log"
    instance = await Dispatcher(pg_store, redis_bus).trigger(
        "ignores_shutdown", {"path": str(gate)}
    )
    await wait_for(lambda: _exists(log), what="the job to start", timeout_s=30)
    claimed = await pg_store.get_instance(instance.id)
    spawn_worker("second", **fast)
    await wait_for(lambda: _workers(pg_store, 2), what="the second worker", timeout_s=30)
    first.send_signal(signal.SIGTERM)

    # Grace, then well past the lease: the first worker still holds it and keeps it alive.
    loop = asyncio.get_running_loop()
    end = loop.time() + 4.0
    while loop.time() < end:
        now = await pg_store.get_instance(instance.id)
        assert now.state is S.PROCESSING and now.worker_id == "first"
        assert now.claim_token == claimed.claim_token
        assert now.lease_expires_at is not None and now.lease_expires_at > await pg_store.now()
        assert first.poll() is None  # waiting for the thread
        await asyncio.sleep(0.1)

    gate.touch()
    assert await asyncio.to_thread(first.wait, 30) == 0
    [done] = await settled(pg_store, [instance.id], timeout_s=60)
    assert done.state is S.SUCCEEDED and done.worker_id == "second"
    assert done.attempt == 2 and done.retries_used == 0
    steps = [(t.from_state, t.to_state, t.reason) for t in await pg_store.transitions(done.id)]
    assert steps == [
        (None, S.ENQUEUED, None),
        (S.ENQUEUED, S.PROCESSING, None),
        (S.PROCESSING, S.ENQUEUED, "worker shutdown"),
        (S.ENQUEUED, S.PROCESSING, None),
        (S.PROCESSING, S.SUCCEEDED, None),
    ]
    lines = (await asyncio.to_thread(log.read_text)).splitlines()
    assert [line.split()[:3] for line in lines] == [
        ["start", "1", "first"],
        ["end", "1", "first"],  # the first run ended before the second began
        ["start", "2", "second"],
        ["end", "2", "second"],
    ]


async def test_the_dead_worker_sweep_frees_the_slot_of_a_killed_workers_runaway(
    pg_store: SqlStore,
    redis_bus: Bus,
    spawn_worker: SpawnWorker,
    tmp_path: Path,
    pg_database_url: str,
    redis_url: str,
    redis_prefix: str,
) -> None:
    first = spawn_worker("first", JOBPLANE_TIMEOUT_GRACE_S="0.5")
    await wait_for(lambda: _has_definitions(pg_store), what="job registration", timeout_s=30)
    gate = tmp_path / "gate"  # never opened: only the kill stops the first attempt
    instance = await Dispatcher(pg_store, redis_bus).trigger("runaway_retried", {"path": str(gate)})
    await wait_for(lambda: _failed(pg_store, instance.id), what="the timeout", timeout_s=30)
    assert await slots_used(pg_store, "runaway_retried") == 1  # held by the running code
    first.kill()
    await asyncio.to_thread(first.wait, 30)
    assert await slots_used(pg_store, "runaway_retried") == 1  # nobody has given it back yet

    # The leader finds the worker silent, marks it dead and gives the slot back; the parked
    # retry is then republished and run by another worker.
    scheduler = spawn_cli(
        "scheduler",
        JOBPLANE_DATABASE_URL=pg_database_url,
        JOBPLANE_REDIS_URL=redis_url,
        JOBPLANE_KEY_PREFIX=redis_prefix,
        JOBPLANE_DEAD_WORKER_AFTER_S="1",
        JOBPLANE_SWEEP_INTERVAL_S="0.2",
        JOBPLANE_REPUBLISH_AFTER_S="1",
    )
    try:
        spawn_worker("second")
        [done] = await settled(pg_store, [instance.id], timeout_s=60)
    finally:
        stop_all([scheduler], sig=signal.SIGTERM)
    assert done.state is S.SUCCEEDED and done.worker_id == "second" and done.attempt == 2
    assert await slots_used(pg_store, "runaway_retried") == 0
    dead = {w.id: w for w in await pg_store.list_workers()}["first"]
    assert dead.stopped_at is not None
    lines = (await asyncio.to_thread((tmp_path / "gate.log").read_text)).splitlines()
    assert [line.split()[:3] for line in lines] == [
        ["start", "1", "first"],  # killed: it never ended
        ["start", "2", "second"],
    ]


async def _workers(store: SqlStore, n: int) -> bool:
    return len(await store.list_workers()) >= n


async def _failed(store: SqlStore, instance_id: UUID) -> bool:
    return any(t.to_state is S.FAILED for t in await store.transitions(instance_id))


async def test_a_worker_marked_dead_while_paused_exits_when_it_resumes(
    pg_store: SqlStore,
    spawn_worker: SpawnWorker,
    pg_database_url: str,
    redis_url: str,
    redis_prefix: str,
) -> None:
    """Frozen past the dead-worker threshold, the worker's slots and pinned instances were
    given away: resumed, its next heartbeat finds it marked stopped and it exits at once
    (status 2) instead of running on; its row is never revived."""
    worker = spawn_worker("paused")
    await wait_for(lambda: _workers(pg_store, 1), what="the worker's registration", timeout_s=30)
    scheduler = spawn_cli(
        "scheduler",
        JOBPLANE_DATABASE_URL=pg_database_url,
        JOBPLANE_REDIS_URL=redis_url,
        JOBPLANE_KEY_PREFIX=redis_prefix,
        JOBPLANE_DEAD_WORKER_AFTER_S="1",
        JOBPLANE_SWEEP_INTERVAL_S="0.2",
    )

    async def marked_stopped() -> bool:
        return {w.id: w for w in await pg_store.list_workers()}["paused"].stopped_at is not None

    try:
        worker.send_signal(signal.SIGSTOP)
        await wait_for(marked_stopped, what="the sweep to mark it stopped", timeout_s=30)
        worker.send_signal(signal.SIGCONT)
        status = await asyncio.to_thread(worker.wait, 30)
    finally:
        stop_all([scheduler], sig=signal.SIGTERM)
    assert status == 2
    assert await marked_stopped()


async def test_a_startup_hook_that_hangs_or_raises_ends_the_worker_in_one_line(
    spawn_worker: SpawnWorker,
) -> None:
    """A startup hook that hung left the worker deaf to SIGTERM and SIGINT for good (only
    SIGKILL ended it); one that raised printed a 62-line traceback and logged nothing. The
    first is cancelled when the worker is told to stop (exit 0); the second is logged with its
    traceback and said in one line (exit 2)."""
    hung = spawn_worker("w-hooks-1", "--app", "tests.apps.hooks:hangs")
    await asyncio.sleep(3)  # (well into its hook)
    assert hung.poll() is None
    hung.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(hung.wait, 20) == 0
    assert "stopped while startup hook connect_forever ran" in output_of(hung)

    failed = spawn_worker("w-hooks-2", "--app", "tests.apps.hooks:fails")
    assert await asyncio.to_thread(failed.wait, 60) == 2
    said = output_of(failed)
    assert (
        "error: startup hook connect_refused failed: RuntimeError: the mail server refused "
        "the connection" in said
    )
    assert "worker.startup_hook_failed" in said or "startup hook connect_refused failed" in said
    assert said.count("Traceback") == 1  # the log record's, not a second one from the CLI
