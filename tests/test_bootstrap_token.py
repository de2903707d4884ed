"""``JOBPLANE_BOOTSTRAP_ADMIN_TOKEN``: ``jobplane migrate`` makes sure it is an admin token, so a
fresh deployment (compose, Kubernetes) is usable without a manual step."""

from __future__ import annotations

import asyncio
import secrets
import subprocess
from collections.abc import Iterator

import httpx
import pytest
import yaml

from jobplane.auth import Role
from jobplane.store.sql import SqlStore
from tests.cli_helpers import ROOT, free_port, run_cli, spawn_cli, stop_all, wait_http_ok


def new_token() -> str:
    return "jp_" + secrets.token_urlsafe(32)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    stop_all(started)


async def test_migrate_provisions_the_token_once_and_the_api_accepts_it(
    pg_database_url: str,
    pg_store: SqlStore,
    redis_url: str,
    redis_prefix: str,
    procs: list[subprocess.Popen[str]],
) -> None:
    secret = new_token()
    env = {"JOBPLANE_DATABASE_URL": pg_database_url, "JOBPLANE_BOOTSTRAP_ADMIN_TOKEN": secret}
    for _ in range(2):  # idempotent: every migrate (each deploy) runs it
        result = await asyncio.to_thread(run_cli, "migrate", env=env)
        assert result.returncode == 0, result.stderr
        assert secret not in result.stderr
    [token] = await pg_store.list_tokens()
    assert (token.name, token.role, token.created_by) == ("bootstrap-admin", Role.ADMIN, "migrate")
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
    )
    procs.append(api)
    await asyncio.to_thread(wait_http_ok, f"http://127.0.0.1:{port}/readyz")
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        ok = await client.get("/api/v1/tokens", headers={"Authorization": f"Bearer {secret}"})
        refused = await client.get("/api/v1/tokens", headers={"Authorization": "Bearer jp_x"})
    assert ok.status_code == 200 and [t["name"] for t in ok.json()] == ["bootstrap-admin"]
    assert refused.status_code == 401


async def test_a_revoked_bootstrap_token_stays_revoked(store: SqlStore) -> None:
    secret = new_token()
    info, created = await store.ensure_token(secret, "bootstrap-admin", Role.ADMIN, "migrate")
    assert created and await store.authenticate(secret) == info
    await store.create_token("second-admin", Role.ADMIN, "test")  # the last admin stays
    assert await store.revoke_token(info.id, "test")
    again, created = await store.ensure_token(secret, "bootstrap-admin", Role.ADMIN, "migrate")
    assert not created and again.id == info.id and again.revoked_at is not None
    assert await store.authenticate(secret) is None
    assert len(await store.list_tokens()) == 2


async def test_racing_migrations_make_one_token(store: SqlStore) -> None:
    secret = new_token()
    results = await asyncio.gather(
        *[store.ensure_token(secret, "bootstrap-admin", Role.ADMIN, "migrate") for _ in range(5)]
    )
    assert sum(created for _, created in results) == 1
    assert len({info.id for info, _ in results}) == 1


@pytest.mark.parametrize("value", ["short", "jp_" + "x" * 10, "xx_" + "a" * 40, "jp_" + "é" * 40])
def test_a_weak_or_malformed_token_is_refused_in_one_line(value: str) -> None:
    result = run_cli(
        "migrate",
        JOBPLANE_DATABASE_URL="sqlite:///unused.db",
        JOBPLANE_BOOTSTRAP_ADMIN_TOKEN=value,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: JOBPLANE_BOOTSTRAP_ADMIN_TOKEN: Value error, must be jp_ followed by at "
        "least 32 URL-safe characters"
    ]


def placeholder_of_the_secret_template() -> str:
    text = (ROOT / "k8s" / "base" / "secret.example.yaml").read_text()
    [template] = [
        d for d in yaml.safe_load_all(text) if d["metadata"]["name"] == "jobplane-bootstrap"
    ]
    value: str = template["stringData"]["JOBPLANE_BOOTSTRAP_ADMIN_TOKEN"]
    return value


@pytest.mark.parametrize(
    "value",
    [
        placeholder_of_the_secret_template(),
        # (Fixed, not random: every xdist worker must collect the same test ids.)
        "jp_Zq3vT8wLk2Rn5Yp7-change-me-Hs4Xc9Jd6Fb1Mg0Kt",
    ],
    ids=["template", "lower-case"],
)
def test_the_templates_placeholder_is_refused_in_one_line(value: str) -> None:
    """Well-formed, the placeholder would otherwise become an admin token whose secret is in
    the repository."""
    result = run_cli(
        "migrate",
        JOBPLANE_DATABASE_URL="sqlite:///unused.db",
        JOBPLANE_BOOTSTRAP_ADMIN_TOKEN=value,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: JOBPLANE_BOOTSTRAP_ADMIN_TOKEN: Value error, is still the template's CHANGE-ME "
        "placeholder: set a random token"
    ]
