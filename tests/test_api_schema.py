"""Schemathesis against the OpenAPI schema of a real `jobplane api` process (Postgres and
Redis, authentication on, an admin token): generated requests, valid and invalid, never get a
5xx and responses conform to the schema; stateful sequences (create, then read back and list
what was created) never get a 5xx, and every instance created can be read back.

The budget is small (a few examples per operation) so that the module takes well under a
minute; schemathesis' own pytest plugin is not used (it does not support this pytest)."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeAlias

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.core.result import Ok
from schemathesis.generation import GenerationMode
from schemathesis.schemas import APIOperation
from schemathesis.specs.openapi.checks import (
    ignored_auth,
    missing_required_header,
    negative_data_rejection,
    positive_data_acceptance,
    unsupported_method,
)

from jobplane.auth import Role
from jobplane.store.factory import open_store
from tests.cli_helpers import free_port, spawn_cli, stop_all, wait_http_ok
from tests.fixtures.bus import delete_prefix
from tests.fixtures.databases import DatabasePool
from tests.fixtures.store import own_database

# An operation of the API and a request generated for it (the operation's type parameters are
# the schema library's own: its parameters, responses, security and schema types).
Operation: TypeAlias = APIOperation[Any, Any, Any, Any]
Case: TypeAlias = schemathesis.Case[Operation]

# One worker runs the module: its api process (a module fixture) starts once.
pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("api-schema")]

#: Checks that do not hold by design. Positive data may still be refused (arguments are
#: validated against each job's own JSON Schema, which OpenAPI cannot express); negative data
#: may be accepted where the API is lenient on purpose (unknown query parameters are ignored,
#: a time without an offset is UTC); a missing or unknown header is not always an error.
EXCLUDED = [
    positive_data_acceptance,
    negative_data_rejection,
    missing_required_header,
    unsupported_method,
    ignored_auth,
]


@dataclass
class Api:
    url: str
    headers: dict[str, str]


@pytest.fixture(scope="module")
def api(pg_databases: DatabasePool, redis_url: str) -> Iterator[Api]:
    prefix = f"jpschema-{uuid.uuid4().hex}"
    with own_database(pg_databases) as db:  # migrated: a copy of the template
        env = {
            "JOBPLANE_DATABASE_URL": db,
            "JOBPLANE_REDIS_URL": redis_url,
            "JOBPLANE_KEY_PREFIX": prefix,
            "JOBPLANE_LOG_LEVEL": "WARNING",
            # Generated requests carry many invalid tokens from one address on purpose.
            "JOBPLANE_AUTH_FAILURES_PER_MINUTE": "0",
        }
        # Straight from the store (``token create`` is tested in test_api_security.py).
        token = asyncio.run(_admin_token(db))
        port = free_port()
        procs: list[subprocess.Popen[str]] = [
            spawn_cli("api", "--host", "127.0.0.1", "--port", str(port), **env),
            # A worker registers real job definitions, so generated triggers meet real schemas.
            spawn_cli("worker", "--app", "tests.apps.basic:app", "--queues", "unused", **env),
        ]
        url = f"http://127.0.0.1:{port}"
        try:
            wait_http_ok(f"{url}/healthz")
            yield Api(url, {"Authorization": f"Bearer {token}"})
        finally:
            try:
                stop_all(procs, sig=signal.SIGTERM)
            finally:
                asyncio.run(delete_prefix(redis_url, prefix))  # the shared Redis keeps nothing


async def _admin_token(database_url: str) -> str:
    store = open_store(database_url)
    try:
        _, secret = await store.create_token("schemathesis", Role.ADMIN, "test")
    finally:
        await store.close()
    return secret


def _operations(api: Api) -> list[Operation]:
    schema = schemathesis.openapi.from_url(f"{api.url}/openapi.json")
    operations: list[Operation] = []
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result  # the schema is the app's own: all of it loads
        operations.append(result.ok())
    assert len(operations) >= 20
    return operations


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_5xx_and_responses_match_the_schema(api: Api, mode: GenerationMode) -> None:
    checked = 0
    calls: list[str] = []
    for operation in _operations(api):

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=8, deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )
        def check(case: Case) -> None:
            calls.append(case.method)
            case.call_and_validate(base_url=api.url, headers=api.headers, excluded_checks=EXCLUDED)

        try:
            check()
        except Unsatisfiable:
            # An operation with no input (GET /healthz) has no invalid request to make.
            assert mode is GenerationMode.NEGATIVE, operation.label
            continue
        checked += 1
    assert checked >= 20 and len(calls) >= 100


def test_stateful_sequences_read_back_what_they_create(api: Api) -> None:
    schema = schemathesis.openapi.from_url(f"{api.url}/openapi.json")
    created: list[str] = []
    calls: list[str] = []

    # (The base class is made at run time from the schema, so the checker cannot see it.)
    class Machine(schema.as_state_machine()):  # type: ignore[misc]
        def get_call_kwargs(self, case: Case) -> dict[str, Any]:
            return {"base_url": api.url, "headers": api.headers}

        def after_call(self, response: Any, case: Case) -> None:
            calls.append(f"{case.method} {case.path} {response.status_code}")
            if response.status_code == 201 and case.path.endswith("/instances"):
                created.append(response.json()["id"])

        def validate_response(self, response: Any, case: Case, **kw: Any) -> None:
            case.validate_response(response, excluded_checks=EXCLUDED)

    Machine.run(
        settings=settings(
            max_examples=30,
            stateful_step_count=8,
            derandomize=True,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
    )
    # Sequences really ran, across most of the API.
    assert len(calls) >= 50 and len({c.rsplit(" ", 1)[0] for c in calls}) >= 12
    with httpx.Client(base_url=api.url, headers=api.headers, timeout=10) as client:
        for instance_id in created:
            assert client.get(f"/api/v1/instances/{instance_id}").status_code == 200
        assert client.get("/api/v1/instances", params={"limit": 500}).status_code == 200


def test_a_request_http_cannot_parse_is_answered_with_a_problem(api: Api) -> None:
    # Generated headers may break HTTP itself (a ``Content-Length`` that is not a number): the
    # server, not the application, answers those, and in the API's format too.
    host, port = api.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(b"GET /api/v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: !8\r\n\r\n")
        answer = b""
        while chunk := conn.recv(4096):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0].startswith("HTTP/1.1 400")
    assert "content-type: application/problem+json" in [line.lower() for line in lines]
    problem = json.loads(body)
    assert problem["status"] == 400 and problem["title"] == "Bad Request" and problem["detail"]
