"""Authentication and roles, generated from the app's route table: a new route cannot slip
through unprotected. Real Postgres and Redis."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from uuid import UUID, uuid4

import httpx
import pytest

from jobplane.auth import Role
from jobplane.bus.abc import Bus
from jobplane.store.factory import open_store
from jobplane.store.sql import SqlStore
from jobplane_api.main import create_app
from jobplane_api.settings import ApiSettings
from tests.api_helpers import AppClient
from tests.apps.basic import app as jobs_app

OPEN = {
    "/healthz",
    "/readyz",
    "/metrics",
    "/openapi.json",
    "/docs",
    "/docs/oauth2-redirect",
    "/redoc",
}
# The least role each route needs: reads are viewer, operations operator, edits admin.
NEEDS = {
    ("GET", "/api/v1/jobs"): Role.VIEWER,
    ("GET", "/api/v1/jobs/{key}"): Role.VIEWER,
    ("PATCH", "/api/v1/jobs/{key}"): Role.ADMIN,
    ("POST", "/api/v1/jobs/{key}/pause"): Role.OPERATOR,
    ("POST", "/api/v1/jobs/{key}/resume"): Role.OPERATOR,
    ("GET", "/api/v1/jobs/{key}/versions"): Role.VIEWER,
    ("POST", "/api/v1/jobs/{key}/rollback"): Role.ADMIN,
    ("POST", "/api/v1/jobs/{key}/instances"): Role.OPERATOR,
    ("GET", "/api/v1/instances"): Role.VIEWER,
    ("POST", "/api/v1/instances/batch"): Role.OPERATOR,
    ("POST", "/api/v1/instances/cancel"): Role.OPERATOR,
    ("POST", "/api/v1/instances/retry"): Role.OPERATOR,
    ("GET", "/api/v1/instances/{instance_id}"): Role.VIEWER,
    ("POST", "/api/v1/instances/{instance_id}/cancel"): Role.OPERATOR,
    ("POST", "/api/v1/instances/{instance_id}/retry"): Role.OPERATOR,
    ("POST", "/api/v1/instances/{instance_id}/run"): Role.OPERATOR,
    ("GET", "/api/v1/workers"): Role.VIEWER,
    ("GET", "/api/v1/scheduler"): Role.VIEWER,
    ("GET", "/api/v1/stats"): Role.VIEWER,
    ("GET", "/api/v1/tokens"): Role.ADMIN,
    ("POST", "/api/v1/tokens"): Role.ADMIN,
    ("DELETE", "/api/v1/tokens/{token_id}"): Role.ADMIN,
}
BELOW = {Role.VIEWER: [], Role.OPERATOR: [Role.VIEWER], Role.ADMIN: [Role.VIEWER, Role.OPERATOR]}


@pytest.fixture
async def pg_store(pg_database_url: str) -> AsyncIterator[SqlStore]:
    store = open_store(pg_database_url)
    for spec in jobs_app.jobs.values():
        await store.register_definition(spec.options, spec.args_schema(), "test")
    yield store
    await store.close()


@pytest.fixture
async def client(pg_store: SqlStore, redis_bus: Bus) -> AsyncIterator[AppClient]:
    api = create_app(ApiSettings(auth_enabled=True), store=pg_store, bus=redis_bus)
    async with api.router.lifespan_context(api), AppClient(api) as c:
        yield c


def _routes(client: AppClient) -> list[tuple[str, str]]:
    """Every operation of the app, from its OpenAPI document (which FastAPI builds from the
    route table)."""
    out: list[tuple[str, str]] = []
    for path, operations in client.app.openapi()["paths"].items():
        if path not in OPEN:
            out.extend((method.upper(), path) for method in operations)
    assert out, "no routes found"
    return out


def _url(path: str) -> str:
    return (
        path.replace("{key}", "echo")
        .replace("{instance_id}", str(uuid4()))
        .replace("{token_id}", str(uuid4()))
    )


async def test_every_route_has_a_declared_role(client: AppClient) -> None:
    assert set(_routes(client)) == set(NEEDS), "a route was added without its role here"


async def test_every_route_refuses_missing_and_bad_tokens(client: AppClient) -> None:
    for method, path in _routes(client):
        for headers in ({}, {"Authorization": "Bearer jp_nope"}, {"Authorization": "Basic x"}):
            response = await client.request(method, _url(path), headers=headers, json={})
            assert response.status_code == 401, (method, path, headers, response.text)
            assert response.headers["www-authenticate"] == "Bearer"
            assert response.headers["content-type"].startswith("application/problem+json")


async def test_every_route_refuses_a_role_too_low(
    client: httpx.AsyncClient, pg_store: SqlStore
) -> None:
    secrets = {role: (await pg_store.create_token(role.value, role, "test"))[1] for role in Role}
    for (method, path), needed in NEEDS.items():
        for role in BELOW[needed]:
            headers = {"Authorization": f"Bearer {secrets[role]}"}
            response = await client.request(method, _url(path), headers=headers, json={})
            assert response.status_code == 403, (method, path, role, response.text)
        headers = {"Authorization": f"Bearer {secrets[needed]}"}
        response = await client.request(method, _url(path), headers=headers, json={})
        assert response.status_code not in (401, 403), (method, path, response.text)


async def test_tokens_are_hashed_shown_once_revocable_and_never_logged(
    client: httpx.AsyncClient, pg_store: SqlStore, caplog: pytest.LogCaptureFixture
) -> None:
    _, admin = await pg_store.create_token("root", Role.ADMIN, "test")
    auth = {"Authorization": f"Bearer {admin}"}
    with caplog.at_level(logging.DEBUG):
        created = await client.post(
            "/api/v1/tokens", json={"name": "ci", "role": "operator"}, headers=auth
        )
        assert created.status_code == 201
        secret = created.json()["secret"]
        listed = (await client.get("/api/v1/tokens", headers=auth)).json()
        assert all("secret" not in t for t in listed) and len(listed) == 2
        ops = {"Authorization": f"Bearer {secret}"}
        trigger = await client.post(
            "/api/v1/jobs/echo/instances", json={"args": {"value": 1}}, headers=ops
        )
        assert trigger.status_code == 201
        revoked = await client.delete(f"/api/v1/tokens/{created.json()['id']}", headers=auth)
        assert revoked.status_code == 204
        again = await client.post(
            "/api/v1/jobs/echo/instances", json={"args": {"value": 1}}, headers=ops
        )
        assert again.status_code == 401
        tokens = {t["name"]: t for t in (await client.get("/api/v1/tokens", headers=auth)).json()}
        assert tokens["ci"]["revoked_by"] == tokens["ci"]["created_by"] == "token:root"
        assert tokens["root"]["revoked_by"] is None
    assert secret not in caplog.text and admin not in caplog.text
    async with pg_store.engine.connect() as conn:
        from sqlalchemy import text

        stored = (await conn.execute(text("SELECT token_hash FROM api_tokens"))).scalars().all()
    assert secret not in stored and all(len(h) == 64 for h in stored)


async def test_health_and_metrics_need_no_token(client: httpx.AsyncClient) -> None:
    for path in ("/healthz", "/readyz", "/metrics"):
        assert (await client.get(path)).status_code == 200


async def test_every_mutating_instance_route_records_the_token_that_acted(
    client: httpx.AsyncClient, pg_store: SqlStore
) -> None:
    """History names who acted: the token's name, never a generic "api"."""
    _, secret = await pg_store.create_token("deploy-bot", Role.OPERATOR, "test")
    auth = {"Authorization": f"Bearer {secret}"}
    batch = await client.post(
        "/api/v1/instances/batch",
        json={"items": [{"job_key": "echo", "args": {"value": 1}}]},
        headers=auth,
    )
    assert batch.status_code == 201, batch.text
    instance_id = batch.json()[0]["id"]
    cancelled = await client.post(f"/api/v1/instances/{instance_id}/cancel", headers=auth)
    assert cancelled.status_code == 200, cancelled.text
    retried = await client.post(f"/api/v1/instances/{instance_id}/retry", headers=auth)
    assert retried.status_code == 201, retried.text
    assert retried.json()["retry_of"] == instance_id

    first = await pg_store.transitions(UUID(instance_id))
    second = await pg_store.transitions(UUID(retried.json()["id"]))
    assert [(t.to_state.value, t.actor) for t in first] == [
        ("enqueued", "token:deploy-bot"),
        ("cancelled", "token:deploy-bot"),
    ]
    assert [t.actor for t in second] == ["token:deploy-bot"]
