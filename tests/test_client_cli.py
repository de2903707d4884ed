"""The Python clients and the REST CLI against a real `jobplane api` process, a worker and a
scheduler, on Postgres and Redis, with authentication on.

The module's tests share one such cluster (started once: four processes, seconds of start-up),
so none depends on what another did: each triggers instances of its own and reads them by id,
the tests that change a definition (an edit, a pause) or count a job's instances have a job of
their own (tests/apps/cli.py), and global counts are compared with what was there before."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta

import pytest

from jobplane.auth import Role
from jobplane.client import ApiError, AsyncClient, Client
from jobplane.store.factory import open_store
from jobplane.store.sql import SqlStore
from tests.cli_helpers import free_port, run_cli, spawn_cli, stop_all, wait_http_ok
from tests.fixtures.bus import delete_prefix
from tests.fixtures.databases import DatabasePool
from tests.fixtures.store import own_database
from tests.worker_helpers import wait_for

# One xdist worker runs the module, so the cluster is started once.
pytestmark = [pytest.mark.long, pytest.mark.timeout(180), pytest.mark.xdist_group("client-cli")]


@pytest.fixture(scope="module")
def stack(pg_databases: DatabasePool, redis_url: str) -> Iterator[dict[str, str]]:
    prefix = f"jptest-{uuid.uuid4().hex}"
    with own_database(pg_databases) as database_url:
        env = {
            "JOBPLANE_DATABASE_URL": database_url,
            "JOBPLANE_REDIS_URL": redis_url,
            "JOBPLANE_KEY_PREFIX": prefix,
            "JOBPLANE_POLL_MS": "100",
        }
        port = free_port()
        two_processes = {"JOBPLANE_API_WORKERS": "2"}
        procs = [
            # Two API processes: every call below may land on either, each with its own
            # remembered definitions, which edits made through the other must not outwit.
            spawn_cli("api", "--host", "127.0.0.1", "--port", str(port), **env, **two_processes),
            spawn_cli("worker", "--app", "tests.apps.cli:app", "--worker-id", "cli-w", **env),
            spawn_cli("scheduler", **env),
        ]
        url = f"http://127.0.0.1:{port}"
        try:
            tokens = asyncio.run(_tokens(database_url))  # while the processes start
            asyncio.run(_registered(database_url, "cli-w"))
            wait_http_ok(f"{url}/healthz")
            yield {"url": url, **tokens, **env}
        finally:
            try:
                stop_all(procs, sig=signal.SIGTERM)
            finally:
                asyncio.run(delete_prefix(redis_url, prefix))


async def _tokens(database_url: str) -> dict[str, str]:
    """An operator, a viewer and an admin token, straight from the store (the ``token create``
    command itself is tested in test_api_security.py; three more CLI starts here would only
    add seconds)."""
    store = open_store(database_url)
    try:
        made = {
            key: await store.create_token(name, role, "test")
            for key, name, role in (
                ("token", "test", Role.OPERATOR),
                ("viewer", "cli", Role.VIEWER),
                ("admin", "cli", Role.ADMIN),
            )
        }
    finally:
        await store.close()
    return {key: secret for key, (_, secret) in made.items()}


async def _registered(database_url: str, worker_id: str) -> None:
    """Wait until the worker has registered (its jobs with it), as every test assumes."""
    store = open_store(database_url)
    try:
        await wait_for(
            lambda: _has_worker(store, worker_id), timeout_s=60, what="the worker's registration"
        )
    finally:
        await store.close()


async def _has_worker(store: SqlStore, worker_id: str) -> bool:
    return any(w.id == worker_id for w in await store.list_workers())


def _cli(
    stack: dict[str, str], *args: str, token: str | None = None
) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, JOBPLANE_API_URL=stack["url"], JOBPLANE_API_TOKEN=token or stack["token"])


def test_cli_trigger_wait_and_listings(stack: dict[str, str]) -> None:
    done = _cli(stack, "trigger", "echo", "--args", '{"value": 3}', "--wait", "-o", "json")
    assert done.returncode == 0, done.stderr
    instance = json.loads(done.stdout)
    assert instance["state"] == "succeeded" and instance["result"]["value"] == 3
    jobs = json.loads(_cli(stack, "jobs", "ls", "-o", "json").stdout)
    assert "echo" in {j["key"] for j in jobs}
    listed = json.loads(_cli(stack, "instances", "ls", "--job", "echo", "-o", "json").stdout)
    assert listed["items"][0]["id"] == instance["id"]
    shown = json.loads(_cli(stack, "instances", "show", instance["id"]).stdout)
    assert [t["to_state"] for t in shown["transitions"]][-1] == "succeeded"
    workers = json.loads(_cli(stack, "workers", "ls", "-o", "json").stdout)
    assert [w["id"] for w in workers] == ["cli-w"]
    table = _cli(stack, "instances", "ls")
    assert table.returncode == 0 and "succeeded" in table.stdout


def test_cli_edit_history_rollback_pause(stack: dict[str, str]) -> None:
    admin = stack["admin"]
    edited = _cli(stack, "jobs", "edit", "edit_me", "--set", "retries=4", "-o", "json", token=admin)
    assert edited.returncode == 0, edited.stderr
    assert json.loads(edited.stdout)["options"]["retries"] == 4
    history = json.loads(_cli(stack, "jobs", "history", "edit_me", "-o", "json").stdout)
    assert [(v["version"], v["action"]) for v in history] == [(2, "edit"), (1, "register")]
    assert history[0]["options"]["retries"] == 4
    original = history[1]["options"]["retries"]
    rolled = _cli(stack, "jobs", "rollback", "edit_me", "1", "-o", "json", token=admin)
    assert rolled.returncode == 0, rolled.stderr
    job = json.loads(rolled.stdout)
    assert job["version"] == 3 and job["options"]["retries"] == original
    table = _cli(stack, "jobs", "history", "edit_me")
    assert table.returncode == 0 and "rollback" in table.stdout
    paused = json.loads(_cli(stack, "jobs", "pause", "edit_me", "-o", "json").stdout)
    assert paused["paused"] is True
    resumed = json.loads(_cli(stack, "jobs", "resume", "edit_me", "-o", "json").stdout)
    assert resumed["paused"] is False
    missing = _cli(stack, "jobs", "rollback", "edit_me", "99", token=admin)
    assert missing.returncode == 1 and "HTTP 404" in missing.stderr
    denied = _cli(stack, "jobs", "rollback", "edit_me", "1")
    assert denied.returncode == 1 and "HTTP 403" in denied.stderr


def test_cli_reports_errors_in_one_line(stack: dict[str, str]) -> None:
    bad = _cli(stack, "trigger", "echo", "--args", '{"value": "x"}')
    assert bad.returncode == 1 and "args.value" in bad.stderr and "Traceback" not in bad.stderr
    denied = _cli(stack, "trigger", "echo", "--args", '{"value": 1}', token=stack["viewer"])
    assert denied.returncode == 1 and "HTTP 403" in denied.stderr
    unknown = _cli(stack, "jobs", "show", "nope")
    assert unknown.returncode == 1 and "HTTP 404" in unknown.stderr
    unauthenticated = _cli(stack, "jobs", "ls", token="jp_wrong")
    assert unauthenticated.returncode == 1 and "HTTP 401" in unauthenticated.stderr


def test_sync_client(stack: dict[str, str]) -> None:
    with Client(stack["url"], stack["token"]) as jp:
        made = jp.trigger("add_sync", {"value": 41}, idempotency_key="k-1")
        assert jp.trigger("add_sync", {"value": 41}, idempotency_key="k-1")["id"] == made["id"]
        done = jp.wait(made["id"], timeout_s=30)
        assert done["state"] == "succeeded" and done["result"] == 42
        with pytest.raises(ApiError) as info:
            jp.cancel(made["id"])
        assert info.value.status == 409
        retried = jp.retry(made["id"], idempotency_key="r-1")
        assert retried["retry_of"] == made["id"]
        assert jp.retry(made["id"], idempotency_key="r-1")["id"] == retried["id"]  # a replay
        assert jp.retry(made["id"])["id"] != retried["id"]  # without a key, another retry


async def test_async_client(stack: dict[str, str]) -> None:
    async with AsyncClient(stack["url"], stack["token"]) as jp:
        made = await jp.trigger("echo", {"value": 5}, delay_s=2)
        assert made["state"] == "scheduled"
        done = await jp.wait(made["id"], timeout_s=30)
        assert done["state"] == "succeeded"
        with pytest.raises(ApiError) as info:
            await jp.trigger("echo", {"value": "five"})
        assert info.value.status == 422
        assert info.value.problem["errors"][0]["field"] == "args.value"


def test_a_key_or_id_with_path_characters_names_no_other_endpoint(stack: dict[str, str]) -> None:
    with Client(stack["url"], stack["admin"]) as jp:
        before = jp.instances(job="add_sync", limit=500)["items"]
        calls: tuple[Callable[[], object], ...] = (
            # As it came, this posted to /api/v1/jobs/add_sync/instances: a trigger.
            lambda: jp.retry("../jobs/add_sync/instances#"),
            lambda: jp.cancel("../jobs/add_sync/instances?"),
            lambda: jp.instance("../workers"),  # the workers' list, as an instance
            lambda: jp.job(".."),  # GET /api/v1/jobs
            lambda: jp.pause("add_sync/../../instances/batch#"),
            lambda: jp.trigger("add_sync?x=1#", {"value": 1}),
        )
        for call in calls:
            with pytest.raises(ApiError) as info:
                call()
            assert info.value.status == 404
        assert jp.instances(job="add_sync", limit=500)["items"] == before


def test_cli_jobs_ls_filters_show_cancel_and_retry(stack: dict[str, str]) -> None:
    assert _cli(stack, "jobs", "pause", "pause_me").returncode == 0
    paused = json.loads(_cli(stack, "jobs", "ls", "--paused", "-o", "json").stdout)
    running = json.loads(_cli(stack, "jobs", "ls", "--no-paused", "-o", "json").stdout)
    with Client(stack["url"], stack["token"]) as jp:
        every = {j["key"]: j["paused"] for j in jp.jobs()}
    # The filters select exactly the paused jobs and exactly the others, as the cluster has
    # them now.
    assert "pause_me" in {j["key"] for j in paused}
    assert sorted(j["key"] for j in paused) == sorted(k for k, p in every.items() if p)
    assert sorted(j["key"] for j in running) == sorted(k for k, p in every.items() if not p)
    assert "pause_me" not in {j["key"] for j in running}
    assert "add_sync" in {j["key"] for j in running}
    found = json.loads(_cli(stack, "jobs", "ls", "--text", "ADD_SY", "-o", "json").stdout)
    assert [j["key"] for j in found] == ["add_sync"]
    shown = _cli(stack, "jobs", "show", "pause_me")
    assert shown.returncode == 0, shown.stderr
    job = json.loads(shown.stdout)
    assert job["key"] == "pause_me" and job["paused"] is True and job["args_schema"]

    with Client(stack["url"], stack["token"]) as jp:
        later = jp.trigger("add_sync", {"value": 1}, delay_s=3600)
    cancelled = _cli(stack, "instances", "cancel", later["id"], "-o", "json")
    assert cancelled.returncode == 0, cancelled.stderr
    assert json.loads(cancelled.stdout)["state"] == "cancelled"
    again = _cli(stack, "instances", "cancel", later["id"])
    assert again.returncode == 1 and "HTTP 409" in again.stderr
    retried = _cli(stack, "instances", "retry", later["id"], "-o", "json")
    assert retried.returncode == 0, retried.stderr
    new = json.loads(retried.stdout)
    assert new["retry_of"] == later["id"] and new["state"] in {
        "enqueued",
        "processing",
        "succeeded",
    }
    with Client(stack["url"], stack["token"]) as jp:
        assert jp.instance(new["id"])["retry_of"] == later["id"]


def test_client_trigger_at_pinned_batch_stats_scheduler(stack: dict[str, str]) -> None:
    with Client(stack["url"], stack["token"]) as jp:
        scheduled_before = jp.stats()["by_state"].get("scheduled", 0)
        at = datetime.now(UTC) + timedelta(hours=1)
        made = jp.trigger("echo", {"value": 1}, run_at=at, pinned_worker="cli-w", priority=2)
        assert made["state"] == "scheduled" and made["pinned_worker"] == "cli-w"
        assert datetime.fromisoformat(made["run_at"]) == at and made["priority"] == 2
        batch = jp.trigger_batch(
            [
                {"job_key": "count_me", "args": {"value": 1}, "idempotency_key": "b-1"},
                {"job_key": "echo", "args": {"value": 2}, "run_at": at},
            ]
        )
        assert [i["state"] for i in batch] == ["enqueued", "scheduled"]
        replay = jp.trigger_batch(
            [{"job_key": "count_me", "args": {"value": 1}, "idempotency_key": "b-1"}]
        )
        assert replay[0]["id"] == batch[0]["id"]
        with pytest.raises(ApiError) as info:
            jp.trigger_batch(
                [{"job_key": "count_me", "args": {"value": 2}, "idempotency_key": "b-1"}]
            )
        assert info.value.status == 409 and "b-1" in str(info.value)
        jp.wait(batch[0]["id"], timeout_s=30)
        stats = jp.stats("count_me")
        assert stats["by_state"] == {"succeeded": 1}
        assert jp.stats()["by_state"]["scheduled"] == scheduled_before + 2
        deadline = time.monotonic() + 30
        while (leader := jp.scheduler())["leader"] is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert leader["leader"] and leader["term"] >= 1
        # A waiting instance is run by hand (as one held by the debug mode would be).
        ran = _cli(stack, "instances", "run", made["id"], "-o", "json")
        assert ran.returncode == 0, ran.stderr
        assert json.loads(ran.stdout)["state"] == "enqueued"  # the row its compare-and-set wrote
        assert jp.wait(made["id"], timeout_s=30)["state"] == "succeeded"
        with pytest.raises(ApiError) as refused:
            jp.run(made["id"])
        assert refused.value.status == 409
