"""The Python clients and the REST CLI against a real `jobplane api` process, a worker and a
scheduler, on Postgres and Redis, with authentication on.

The module's tests share one such cluster (started once: four processes, seconds of start-up),
so none depends on what another did: each triggers instances of its own and reads them by id,
the tests that change a definition (an edit, a pause) or count a job's instances have a job of
their own (tests/apps/cli.py), and global counts are compared with what was there before."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import threading
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


def test_cli_tables_show_text_as_written_and_bad_input_is_one_line(stack: dict[str, str]) -> None:
    """A table cell was rich markup: a token named "[/b]" made `jobs history` a MarkupError
    traceback for everyone, and "[red]x[/red]" showed as a red "x". Arguments nested 5,000
    deep, NaN or Infinity, and options the client took for its own parameters (`key`,
    `version`) were tracebacks too."""
    for name, act in (("[/b]M", "pause"), ("[i]N", "resume")):
        secret = asyncio.run(_token(stack["JOBPLANE_DATABASE_URL"], name))
        assert _cli(stack, "jobs", act, "markup_me", token=secret).returncode == 0
    history = _cli(stack, "jobs", "history", "markup_me")
    assert history.returncode == 0, history.stderr
    assert "token:[/b]M" in history.stdout and "token:[i]N" in history.stdout

    admin = stack["admin"]
    for args, code, said in (
        (("trigger", "echo", "--args", "[" * 5000 + "]" * 5000), 2, "nested too deep"),
        (("trigger", "echo", "--args", '{"value": NaN}'), 2, "NaN is not a JSON number"),
        (("trigger", "echo", "--args", '{"value": 1}', "--delay", "nan"), 1, "delay_s"),
        (("jobs", "edit", "markup_me", "--set", "timeout_s=Infinity"), 2, "Infinity is not"),
        (("jobs", "edit", "markup_me", "--set", "key=renamed"), 1, "cannot be changed"),
        (("jobs", "edit", "markup_me", "--set", "version=3"), 1, "version"),
        (("jobs", "show", ""), 1, "names nothing"),
    ):
        result = _cli(stack, *args, token=admin)
        assert result.returncode == code, (args[:3], result.stderr[-500:])
        assert said in result.stderr and "Traceback" not in result.stderr, result.stderr[-500:]


def test_the_client_says_what_is_wrong_without_a_traceback_or_the_token(
    stack: dict[str, str],
) -> None:
    """A token read from a file with its line break failed as "cannot reach the Jobplane
    API", quoting the header, the whole token; a non-ASCII Idempotency-Key was a
    UnicodeEncodeError; a URL with a bad port an InvalidURL or OverflowError; an API that did
    not answer "cannot reach the Jobplane API: " and nothing; an answer that is no JSON (a
    redirect, a page) a JSONDecodeError; a boolean priority or delay was read as 1."""
    from jobplane.errors import ConfigurationError, InvalidOptionsError, JobplaneError

    token = stack["token"]
    with pytest.raises(ConfigurationError, match="line break") as info:
        Client(stack["url"], token + "\n")
    assert token not in str(info.value)
    for url in ("http://[::1", "http://127.0.0.1:70000"):
        with pytest.raises(ConfigurationError, match="API URL"):
            Client(url, token)
    with Client(stack["url"], token) as jp:
        with pytest.raises(InvalidOptionsError, match="idempotency_key"):
            jp.trigger("echo", {"value": 1}, idempotency_key="café")
        with pytest.raises(InvalidOptionsError, match="delay_s"):
            jp.trigger("echo", {"value": 1}, delay_s=float("inf"))
        with pytest.raises(InvalidOptionsError, match=r"items\.0\.delay_s"):
            jp.trigger_batch([{"job_key": "echo", "args": {"value": 1}, "delay_s": float("nan")}])
        for field in ("priority", "delay_s"):
            with pytest.raises(ApiError) as refused:
                jp.trigger("echo", {"value": 1}, **{field: True})  # type: ignore[arg-type]
            [error] = refused.value.problem["errors"]
            assert error["field"] == f"body.{field}" and "not true or false" in error["reason"]

    moved = b"HTTP/1.1 301 Moved\r\nLocation: https://x/\r\nContent-Length: 0\r\n\r\n"
    page = b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: 6\r\n\r\n<html>"
    for answer, said, timeout_s in (
        (moved, "redirect to https", 30.0),
        (page, "is not JSON", 30.0),
        (None, r"did not answer within 0\.5 s", 0.5),  # accepts, never answers
    ):
        with (
            _server(answer) as url,
            Client(url, token, timeout_s=timeout_s) as jp,
            pytest.raises(JobplaneError, match=said),
        ):
            jp.jobs()


@contextlib.contextmanager
def _server(answer: bytes | None) -> Iterator[str]:
    """A one-thread HTTP server that answers every request with ``answer`` (None: never)."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.1)
        held = []
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            held.append(conn)
            conn.recv(65536)
            if answer is not None:
                conn.sendall(answer)
        for conn in held:
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        listener.close()


async def _token(database_url: str, name: str) -> str:
    store = open_store(database_url)
    try:
        _, secret = await store.create_token(name, Role.OPERATOR, "test")
    finally:
        await store.close()
    return secret
