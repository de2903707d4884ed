"""The authorization matrix, generated from the app's OpenAPI document: every operation by
every kind of caller gets the status the document gives it. A route added without a role
shows up here as an undocumented open route and fails.

Callers: no token, a malformed header, a revoked token, an expired token, and a live token
of each role. Expected: 401 for the first four; 403 for a role below the operation's
``x-jobplane-role``; for a role high enough, a status the operation documents and never a
5xx. Real Postgres and Redis, one app for the whole matrix."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from uuid import uuid4

import pytest
import pytest_asyncio
from sqlalchemy import text

from jobplane.auth import ORDER, Role
from jobplane_api.security import ROLE_EXTENSION
from jobplane_api.settings import ApiSettings
from tests.api_helpers import LiveApi, live_api

pytestmark = pytest.mark.asyncio(loop_scope="module")

#: The only operations open to anyone: they carry no job data.
OPEN = {("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/metrics")}
REFUSED = ("none", "malformed", "revoked", "expired")


@dataclass
class Matrix:
    live: LiveApi
    headers: dict[str, dict[str, str]]
    operations: list[tuple[str, str, dict[str, Any]]]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def matrix(postgres_url: str, pg_template: str, redis_url: str) -> AsyncIterator[Matrix]:
    # The failure throttle is off here: the matrix makes ~90 refused requests a minute on
    # purpose (the throttle has its own test).
    settings = ApiSettings(auth_enabled=True, auth_failures_per_minute=0)
    async with live_api(postgres_url, pg_template, redis_url, settings) as live:
        store = live.store
        headers: dict[str, dict[str, str]] = {"none": {}, "malformed": {"Authorization": "Token x"}}
        for role in Role:
            _, secret = await store.create_token(role.value, role, "test")
            headers[role.value] = {"Authorization": f"Bearer {secret}"}
        revoked, secret = await store.create_token("revoked", Role.ADMIN, "test")
        await store.revoke_token(revoked.id, "test")
        headers["revoked"] = {"Authorization": f"Bearer {secret}"}
        expired, secret = await store.create_token("expired", Role.ADMIN, "test")
        async with store.engine.begin() as conn:
            await conn.execute(
                text("UPDATE api_tokens SET expires_at = now() - interval '1 s' WHERE id = :id"),
                {"id": expired.id},
            )
        headers["expired"] = {"Authorization": f"Bearer {secret}"}
        document = live.client.app.openapi()
        operations = [
            (method.upper(), path, operation)
            for path, methods in document["paths"].items()
            for method, operation in methods.items()
        ]
        yield Matrix(live, headers, operations)


def _url(path: str) -> str:
    return (
        path.replace("{key}", "echo")
        .replace("{instance_id}", str(uuid4()))
        .replace("{token_id}", str(uuid4()))
    )


def _expected(operation: dict[str, Any], caller: str) -> set[int] | None:
    """The statuses the document allows ``caller``; None: any documented non-5xx."""
    needed = operation[ROLE_EXTENSION]
    if caller in REFUSED:
        return {401}
    if ORDER[Role(caller)] < ORDER[Role(needed)]:
        return {403}
    return None


async def test_every_operation_needs_a_documented_role(matrix: Matrix) -> None:
    unprotected = {(m, p) for m, p, op in matrix.operations if ROLE_EXTENSION not in op}
    assert unprotected == OPEN, "an operation has no role, or an open one is not listed"
    for _, path, operation in matrix.operations:
        if path.startswith("/api/"):
            assert {"401", "403"} <= set(operation["responses"]), path
            assert operation["security"] == [{"bearer": []}], path


@pytest.mark.parametrize("caller", [*REFUSED, *(r.value for r in Role)])
async def test_the_matrix(matrix: Matrix, caller: str) -> None:
    deviations = []
    requests = 0
    for method, path, operation in matrix.operations:
        if (method, path) in OPEN:
            continue
        response = await matrix.live.client.request(
            method, _url(path), headers=matrix.headers[caller], json={}
        )
        requests += 1
        expected = _expected(operation, caller)
        documented = {int(code) for code in operation["responses"] if code.isdigit()}
        ok = (
            response.status_code in expected
            if expected is not None
            else response.status_code in documented and response.status_code < 500
        )
        if not ok:
            deviations.append((method, path, response.status_code, response.text[:200]))
        if response.status_code == 401:
            assert response.headers["www-authenticate"] == "Bearer"
    assert requests >= 20
    assert deviations == [], deviations
