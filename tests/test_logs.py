"""JOBPLANE_LOG_FORMAT=json: one JSON object per line, with every structured field."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
from collections.abc import Iterator
from uuid import uuid4

import pytest

from jobplane.bus.factory import open_bus
from jobplane.dispatch import Dispatcher
from jobplane.domain.states import InstanceState
from jobplane.logs import JsonFormatter
from jobplane.store.sql import SqlStore
from tests.cli_helpers import (
    free_port,
    output_of,
    spawn_cli,
    stop_all,
    wait_for_output,
    wait_http_ok,
)
from tests.worker_helpers import settled


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    stop_all(started)


def json_lines(text: str) -> list[dict[str, object]]:
    """Every line parsed as JSON (a line that is not JSON fails the test), except the
    one-line ``error:`` a role may end with."""
    return [json.loads(ln) for ln in text.splitlines() if ln and not ln.startswith("error:")]


def test_the_formatter_writes_extra_static_and_exception_fields() -> None:
    formatter = JsonFormatter({"role": "worker", "worker_id": "w-1"})
    instance_id = uuid4()
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.getLogger("jobplane.test").makeRecord(
            "jobplane.test",
            logging.ERROR,
            __file__,
            1,
            "failed %s",
            ("once",),
            sys.exc_info(),
            extra={"action": "worker.failed", "instance_id": instance_id, "job_key": "greet"},
        )
    body = json.loads(formatter.format(record))
    assert body["message"] == "failed once" and body["level"] == "ERROR"
    assert body["logger"] == "jobplane.test" and body["ts"].endswith("+00:00")
    assert body["role"] == "worker" and body["worker_id"] == "w-1"
    assert body["action"] == "worker.failed" and body["job_key"] == "greet"
    assert body["instance_id"] == str(instance_id)  # not JSON itself: written as str()
    assert "ValueError: boom" in body["exc"]
    assert "\n" not in formatter.format(record)  # one line, even with a traceback


async def test_a_worker_logs_json_with_job_and_worker_fields(
    pg_database_url: str,
    pg_store: SqlStore,
    redis_url: str,
    redis_prefix: str,
    procs: list[subprocess.Popen[str]],
) -> None:
    worker = spawn_cli(
        "worker",
        "--app",
        "examples.hello:app",
        "--worker-id",
        "json-worker",
        JOBPLANE_DATABASE_URL=pg_database_url,
        JOBPLANE_REDIS_URL=redis_url,
        JOBPLANE_KEY_PREFIX=redis_prefix,
        JOBPLANE_LOG_FORMAT="json",
    )
    procs.append(worker)
    await wait_for_output(worker, "worker.ready")
    bus = open_bus(redis_url, redis_prefix)
    try:
        instance = await Dispatcher(pg_store, bus).trigger("greet", {"name": "Ada"})
        [done] = await settled(pg_store, [instance.id], timeout_s=30)
    finally:
        await bus.close()
    assert done.state is InstanceState.SUCCEEDED
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=60) == 0
    lines = json_lines(output_of(worker))
    assert lines and all(line["role"] == "worker" for line in lines)
    assert all(line["worker_id"] == "json-worker" for line in lines)
    [greeting] = [ln for ln in lines if str(ln["message"]).endswith("greeting Ada")]
    assert greeting["instance_id"] == str(instance.id) and greeting["job_key"] == "greet"
    assert greeting["attempt"] == 1
    assert any(ln.get("instance_id") == str(instance.id) and "action" in ln for ln in lines)


async def test_the_api_and_uvicorn_log_json(
    pg_database_url: str, redis_url: str, redis_prefix: str, procs: list[subprocess.Popen[str]]
) -> None:
    port = free_port()
    api = spawn_cli(
        "api",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        JOBPLANE_DATABASE_URL=pg_database_url,
        JOBPLANE_REDIS_URL=redis_url,
        JOBPLANE_KEY_PREFIX=redis_prefix,
        JOBPLANE_LOG_FORMAT="json",
    )
    procs.append(api)
    wait_http_ok(f"http://127.0.0.1:{port}/healthz")
    api.send_signal(signal.SIGTERM)
    assert api.wait(timeout=30) == 0
    lines = json_lines(output_of(api))
    loggers = {line["logger"] for line in lines}
    assert {"uvicorn.error", "uvicorn.access"} <= loggers, loggers
    assert all(line["role"] == "api" and "color_message" not in line for line in lines)
