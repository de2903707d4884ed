"""Authentication first, failed-auth throttle and negative cache (shared by the API and the
dashboard's login and session cookie), token lifecycle (expiry, last use, the last admin,
recovery from the database), security headers and local docs. Real Postgres and Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from uuid import uuid4

import httpx
import pytest
from sqlalchemy import text

from jobplane.auth import Role, hash_secret, new_secret, parse_duration
from jobplane.bus.abc import Bus
from jobplane.errors import LastAdminError
from jobplane.store.sql import SqlStore
from jobplane_api.authn import Authenticator, Refusal
from jobplane_api.dashboard.session import COOKIE, csrf_token
from jobplane_api.main import DEFAULT_CSP, create_app
from jobplane_api.settings import ApiSettings
from tests.api_helpers import AppClient
from tests.apps.basic import app as jobs_app
from tests.cli_helpers import free_port, run_cli, spawn_cli, stop_all, wait_http_ok


@pytest.fixture
async def client(pg_store: SqlStore, redis_bus: Bus) -> AsyncIterator[AppClient]:
    for spec in jobs_app.jobs.values():
        await pg_store.register_definition(spec.options, spec.args_schema(), "test")
    settings = ApiSettings(auth_enabled=True, auth_failures_per_minute=5, max_body_bytes=4096)
    api = create_app(settings, store=pg_store, bus=redis_bus)
    async with api.router.lifespan_context(api), AppClient(api) as c:
        yield c


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


#: A dashboard visitor who is not logged in, and the CSRF token of its forms.
ANONYMOUS = "anon.visitor"
LOGIN_CSRF = csrf_token(ANONYMOUS)


def session(cookie: str, **headers: str) -> dict[str, str]:
    """A request's dashboard session cookie, as the browser sends it (over the client's jar,
    which the answers' Set-Cookie would otherwise change)."""
    return {"Cookie": f"{COOKIE}={cookie}", **headers}


async def log_in(client: httpx.AsyncClient, secret: str) -> httpx.Response:
    return await client.post(
        "/login", data={"token": secret, "csrf": LOGIN_CSRF}, headers=session(ANONYMOUS)
    )


async def test_no_token_is_401_whatever_the_body(client: httpx.AsyncClient) -> None:
    url = "/api/v1/jobs/echo/instances"
    for request in (
        {"content": b"{not json", "headers": {"content-type": "application/json"}},
        {"content": b"x" * 10_000},  # over the body limit
        {"json": {"args": [[[[1]]]], "unknown": True}},  # invalid
    ):
        response = await client.post(url, **request)
        assert response.status_code == 401, response.text
        assert response.headers["www-authenticate"] == "Bearer"
    assert (await client.get("/api/v1/instances/%00")).status_code == 401


async def test_failed_authentications_are_throttled_per_client(
    client: httpx.AsyncClient, pg_store: SqlStore
) -> None:
    _, good = await pg_store.create_token("ops", Role.OPERATOR, "test")
    for _ in range(5):
        assert (await client.get("/api/v1/jobs", headers=bearer(new_secret()))).status_code == 401
    throttled = await client.get("/api/v1/jobs", headers=bearer(new_secret()))
    assert throttled.status_code == 429, throttled.text
    assert 1 <= int(throttled.headers["retry-after"]) <= 60
    assert throttled.headers["content-type"].startswith("application/problem+json")
    # The limit is on this client (address), for the rest of the minute: a good token too.
    assert (await client.get("/api/v1/jobs", headers=bearer(good))).status_code == 429


async def test_the_dashboard_shares_the_api_throttle(
    client: httpx.AsyncClient, pg_store: SqlStore
) -> None:
    """Failures of a bearer header, the login form and the session cookie count together
    for the client (5 a minute here); then every one of them answers 429 with Retry-After,
    for a good secret as for a wrong one (no oracle), in HTML, or as short text to the
    pages' polling script. The dashboard looked secrets up without counting them before."""
    _, good = await pg_store.create_token("ops", Role.OPERATOR, "test")
    for _ in range(2):  # a good secret is no failure
        assert (await client.get("/jobs", headers=session(good))).status_code == 200
    assert (await client.get("/api/v1/jobs", headers=bearer(new_secret()))).status_code == 401
    for _ in range(2):
        refused = await log_in(client, new_secret())
        assert refused.status_code == 401 and "Unknown or revoked token." in refused.text
        assert "set-cookie" not in refused.headers
    for _ in range(2):  # an unknown cookie: an anonymous session, told to log in
        gate = await client.get("/jobs", headers=session(new_secret()))
        assert gate.status_code == 303
        assert gate.headers["location"] == "/login?next=/jobs&ended=page"
        assert f"{COOKIE}=anon." in gate.headers["set-cookie"]  # the browser forgets it

    for secret in (good, new_secret()):
        page = await client.get("/jobs", headers=session(secret))
        assert page.status_code == 429, page.text[:500]
        assert 1 <= int(page.headers["retry-after"]) <= 60
        assert page.headers["content-type"].startswith("text/html")
        assert "too many failed authentications" in page.text
        assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
        assert "set-cookie" not in page.headers
        polled = await client.get("/?partial=1", headers=session(secret, **{"X-Live": "1"}))
        assert polled.status_code == 429 and polled.headers["retry-after"]
        assert polled.headers["content-type"].startswith("text/plain") and len(polled.text) < 80
        login = await log_in(client, secret)
        assert login.status_code == 429 and login.headers["retry-after"]
        assert "set-cookie" not in login.headers  # not logged in
        api = await client.get("/api/v1/jobs", headers=bearer(secret))
        assert api.status_code == 429 and api.headers["retry-after"]
    # Nothing to check, nothing refused: the login form itself still shows.
    assert (await client.get("/login", headers=session(ANONYMOUS))).status_code == 200


async def test_the_dashboard_remembers_unknown_secrets(
    client: httpx.AsyncClient, pg_store: SqlStore
) -> None:
    """A secret the cookie or the login form sent and the store did not know is answered
    from the API's negative cache: it stays refused (no lookup) for a few seconds even if it
    became valid meanwhile. Live tokens are never cached: a revoked one ends its session at
    once, and the answer replaces the cookie, so that a polling tab stops sending it."""
    secret = new_secret()
    assert (await client.get("/jobs", headers=session(secret))).status_code == 303
    # The secret becomes valid behind the cache's back (as if created for it just now).
    info, _ = await pg_store.create_token("late", Role.VIEWER, "test")
    async with pg_store.engine.begin() as conn:
        await conn.execute(
            text("UPDATE api_tokens SET token_hash = :h WHERE id = :id"),
            {"h": hash_secret(secret), "id": info.id},
        )
    assert (await client.get("/jobs", headers=session(secret))).status_code == 303
    assert (await log_in(client, secret)).status_code == 401

    live, live_secret = await pg_store.create_token("live", Role.VIEWER, "test")
    for _ in range(6):  # over the failure limit if a live token counted (or were cached)
        page = await client.get("/jobs", headers=session(live_secret))
        assert page.status_code == 200
    assert await pg_store.revoke_token(live.id, "test")
    polled = await client.get("/?partial=1", headers=session(live_secret, **{"X-Live": "1"}))
    assert polled.status_code == 401 and f"{COOKIE}=anon." in polled.headers["set-cookie"]
    gate = await client.get("/jobs", headers=session(live_secret))
    assert gate.status_code == 303 and gate.headers["location"].startswith("/login")


async def test_the_dashboard_without_authentication_checks_no_secret(
    pg_store: SqlStore, redis_bus: Bus
) -> None:
    """``jobplane dev``: any cookie is an admin session and the login form lets everyone in,
    so nothing is looked up, counted or throttled."""
    settings = ApiSettings(auth_enabled=False, auth_failures_per_minute=1)
    api = create_app(settings, store=pg_store, bus=redis_bus)
    async with api.router.lifespan_context(api), AppClient(api) as dev:
        for _ in range(3):
            assert (await dev.get("/jobs", headers=session(new_secret()))).status_code == 200
            signed = await log_in(dev, new_secret())
            assert signed.status_code == 303 and signed.headers["location"] == "/"
        assert (await dev.get("/api/v1/jobs", headers=bearer(new_secret()))).status_code == 200


async def test_unknown_secrets_are_remembered_briefly(pg_store: SqlStore) -> None:
    now = [1000.0]
    auth = Authenticator(failures_per_minute=0, negative_ttl_s=10, clock=lambda: now[0])
    secret = new_secret()
    with pytest.raises(Refusal):
        await auth.authenticate(pg_store, f"Bearer {secret}", "c1")
    # The secret becomes valid behind the cache's back (as if created for it just now).
    info, _ = await pg_store.create_token("late", Role.VIEWER, "test")
    async with pg_store.engine.begin() as conn:
        await conn.execute(
            text("UPDATE api_tokens SET token_hash = :h WHERE id = :id"),
            {"h": hash_secret(secret), "id": info.id},
        )
    with pytest.raises(Refusal) as cached:
        await auth.authenticate(pg_store, f"Bearer {secret}", "c1")
    assert cached.value.status == 401  # answered from the cache: no lookup
    now[0] += 11
    assert (await auth.authenticate(pg_store, f"Bearer {secret}", "c1")).id == info.id


async def test_expired_tokens_are_refused_and_last_use_is_noted_cheaply(
    client: httpx.AsyncClient, pg_store: SqlStore
) -> None:
    _, admin = await pg_store.create_token("root", Role.ADMIN, "test")
    created = await client.post(
        "/api/v1/tokens",
        json={"name": "short", "role": "viewer", "expires_in_s": 3600},
        headers=bearer(admin),
    )
    assert created.status_code == 201 and created.headers["cache-control"] == "no-store"
    token = created.json()
    expires = datetime.fromisoformat(token["expires_at"])
    assert timedelta(minutes=59) < expires - datetime.now(UTC) <= timedelta(hours=1)
    assert token["last_used_at"] is None
    viewer = bearer(token["secret"])
    assert (await client.get("/api/v1/jobs", headers=viewer)).status_code == 200

    async def last_used() -> datetime | None:
        [t] = [t for t in await pg_store.list_tokens() if t.name == "short"]
        return t.last_used_at

    first = await last_used()
    assert first is not None
    assert (await client.get("/api/v1/jobs", headers=viewer)).status_code == 200
    assert await last_used() == first  # not written again within the minute
    async with pg_store.engine.begin() as conn:
        await conn.execute(
            text("UPDATE api_tokens SET last_used_at = now() - interval '2 minutes'")
        )
    assert (await client.get("/api/v1/jobs", headers=viewer)).status_code == 200
    later = await last_used()
    assert later is not None and later > first - timedelta(minutes=1)

    async with pg_store.engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE api_tokens SET expires_at = now() - interval '1 second'"
                " WHERE name = 'short'"
            )
        )
    refused = await client.get("/api/v1/jobs", headers=viewer)
    assert refused.status_code == 401 and "expired" in refused.json()["detail"]
    bad = await client.post(
        "/api/v1/tokens", json={"name": "x", "role": "viewer", "expires_in_s": 1},
        headers=bearer(admin),
    )  # fmt: skip
    assert bad.status_code == 422


async def test_the_last_admin_token_cannot_be_revoked(
    client: httpx.AsyncClient, pg_store: SqlStore
) -> None:
    first, first_secret = await pg_store.create_token("root", Role.ADMIN, "test")
    await pg_store.create_token("ops", Role.OPERATOR, "test")
    refused = await client.delete(f"/api/v1/tokens/{first.id}", headers=bearer(first_secret))
    assert refused.status_code == 409, refused.text
    assert "last live admin" in refused.json()["detail"]
    second, second_secret = await pg_store.create_token("root2", Role.ADMIN, "test")
    done = await client.delete(f"/api/v1/tokens/{first.id}", headers=bearer(second_secret))
    assert done.status_code == 204
    with pytest.raises(LastAdminError):
        await pg_store.revoke_token(second.id, "test")
    unknown = await client.delete(f"/api/v1/tokens/{uuid4()}", headers=bearer(second_secret))
    assert unknown.status_code == 404


def test_an_admin_token_is_recovered_from_the_database(pg_database_url: str) -> None:
    env = {"JOBPLANE_DATABASE_URL": pg_database_url}
    made = run_cli("token", "create", "--role", "admin", "--name", "recovery",
                   "--expires-in", "2h", env=env)  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip().startswith("jp_")
    listed = run_cli("token", "ls", env=env)
    assert "recovery" in listed.stdout and "expires" in listed.stdout, listed.stdout
    bad = run_cli("token", "create", "--role", "admin", "--expires-in", "soon", env=env)
    assert bad.returncode == 2 and "--expires-in" in bad.stderr
    # As the API takes them: an admin token expired at birth, a nameless one, and a name the
    # database refused (a raw "value too long") were made or tried.
    for flags, hint in (
        (("--expires-in", "0d"), "--expires-in"),
        (("--expires-in", "59s"), "--expires-in"),
        (("--expires-in", "999999d"), "--expires-in"),
        (("--name", ""), "--name"),
        (("--name", "x" * 201), "--name"),
    ):
        refused = run_cli("token", "create", "--role", "admin", *flags, env=env)
        assert refused.returncode == 2 and hint in refused.stderr, (flags, refused.stderr)
    assert run_cli("token", "ls", env=env).stdout.count("\n") == 1  # (none was made)


async def test_an_expired_token_is_listed_expired(pg_store: SqlStore, pg_database_url: str) -> None:
    """It was listed "live, expires <a time already past>"."""
    await pg_store.create_token("gone", Role.VIEWER, "test", expires_in=timedelta(seconds=-1))
    await pg_store.create_token("later", Role.VIEWER, "test", expires_in=timedelta(hours=1))
    listed = run_cli("token", "ls", env={"JOBPLANE_DATABASE_URL": pg_database_url}).stdout
    [gone] = [line for line in listed.splitlines() if "gone" in line]
    [later] = [line for line in listed.splitlines() if "later" in line]
    assert "(expired 20" in gone and "(live, expires 20" in later


def test_durations() -> None:
    assert parse_duration("90s") == timedelta(seconds=90)
    assert parse_duration("30d") == timedelta(days=30)
    for bad in ("", "1w", "-5m", "5"):
        with pytest.raises(ValueError):
            parse_duration(bad)


async def test_security_headers_and_local_docs(client: AppClient) -> None:
    for path in ("/healthz", "/api/v1/jobs", "/openapi.json", "/docs"):
        assert (await client.get(path)).headers["x-content-type-options"] == "nosniff"
    docs = await client.get("/docs")
    assert docs.status_code == 200
    policy = docs.headers["content-security-policy"]
    assert "script-src 'self' 'sha256-" in policy and "unsafe-inline" not in policy.split(";")[1]
    assert "https://" not in docs.text and "cdn" not in docs.text
    for page in ("/redoc", "/docs/oauth2-redirect"):
        response = await client.get(page)
        assert response.status_code == 200 and "https://" not in response.text.split("<body")[0]
        assert "content-security-policy" in response.headers
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js"):
        served = await client.get(f"/docs/assets/{asset}")
        assert served.status_code == 200 and len(served.content) > 10_000, asset

    from fastapi.responses import HTMLResponse

    client.app.add_api_route(
        "/plain-html", lambda: HTMLResponse("<p>hi</p>"), include_in_schema=False
    )
    plain = await client.get("/plain-html")
    assert plain.headers["content-security-policy"] == DEFAULT_CSP


async def test_openapi_declares_the_bearer_scheme(client: httpx.AsyncClient) -> None:
    document = (await client.get("/openapi.json")).json()
    assert document["components"]["securitySchemes"]["bearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": document["components"]["securitySchemes"]["bearer"]["description"],
    }
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            protected = path.startswith("/api/")
            assert (operation.get("security") == [{"bearer": []}]) == protected, (method, path)


async def test_lists_leave_large_values_out(client: httpx.AsyncClient, pg_store: SqlStore) -> None:
    _, ops = await pg_store.create_token("ops", Role.OPERATOR, "test")
    big = {"blob": "x" * 3000}  # over the list limit, under the body limit
    made = [
        (await client.post("/api/v1/jobs/sleepy/instances", json={"args": a},
                           headers=bearer(ops))).json()["id"]
        for a in (big, {"small": 1})
    ]  # fmt: skip
    page = (await client.get("/api/v1/instances", headers=bearer(ops))).json()["items"]
    by_id = {i["id"]: i for i in page}
    assert by_id[made[0]]["args"] is None and by_id[made[0]]["omitted"] == ["args"]
    assert by_id[made[1]]["args"] == {"small": 1} and by_id[made[1]]["omitted"] == []
    one = (await client.get(f"/api/v1/instances/{made[0]}", headers=bearer(ops))).json()
    assert one["args"] == big and one["omitted"] == []


async def test_metrics_cost_three_statements_and_are_cached(
    client: httpx.AsyncClient, pg_store: SqlStore
) -> None:
    from sqlalchemy import event

    _, ops = await pg_store.create_token("ops", Role.OPERATOR, "test")
    for job in ("sleepy", "sleepy", "always_fails"):
        await client.post(f"/api/v1/jobs/{job}/instances", json={}, headers=bearer(ops))
    statements: list[str] = []

    def count(_c: object, _cur: object, statement: str, *_: object) -> None:
        statements.append(statement)

    event.listen(pg_store.engine.sync_engine, "before_cursor_execute", count)
    try:
        first = await client.get("/metrics")
        assert len(statements) == 3, statements  # the counts, the definitions, the workers
        again = await client.get("/metrics")
        assert len(statements) == 3
        # The cluster figures are reused (the process's own request figures move on).
        assert _cluster_figures(again.text) == _cluster_figures(first.text)
    finally:
        event.remove(pg_store.engine.sync_engine, "before_cursor_execute", count)
    assert 'jobplane_instances{job="sleepy",state="enqueued"} 2.0' in first.text
    assert 'jobplane_instances{job="always_fails",state="enqueued"} 1.0' in first.text
    assert "jobplane_workers 0.0" in first.text


def _cluster_figures(text: str) -> list[str]:
    return [line for line in text.splitlines() if "jobplane_api_" not in line]


async def test_a_role_too_low_is_403_before_the_body_is_validated(
    client: httpx.AsyncClient, pg_store: SqlStore
) -> None:
    _, viewer = await pg_store.create_token("v", Role.VIEWER, "test")
    url = "/api/v1/jobs/echo/instances"
    invalid = await client.post(url, json={"args": "x", "nope": 1}, headers=bearer(viewer))
    assert invalid.status_code == 403, invalid.text
    # A body that is not JSON at all is refused while it is read, before any role check.
    garbage = await client.post(
        url, content=b"{oops", headers={**bearer(viewer), "content-type": "application/json"}
    )
    assert garbage.status_code == 422, garbage.text
    assert garbage.json()["detail"] == "JSON decode error"


@pytest.mark.long
@pytest.mark.parametrize("trusted", ["", "127.0.0.1"])
def test_forwarded_headers_name_the_client_only_from_trusted_proxies(
    trusted: str, pg_database_url: str, redis_url: str, redis_prefix: str
) -> None:
    """A real ``jobplane api`` (uvicorn): by uvicorn's default every process on the api's host
    was a trusted proxy, so its ``X-Forwarded-For`` named the client whose failures the
    throttle counts (never throttled by changing it, or another address throttled at will).
    Now only the proxies ``FORWARDED_ALLOW_IPS`` lists are believed."""
    port = free_port()
    env = {
        "JOBPLANE_DATABASE_URL": pg_database_url,
        "JOBPLANE_REDIS_URL": redis_url,
        "JOBPLANE_KEY_PREFIX": redis_prefix,
        "JOBPLANE_AUTH_FAILURES_PER_MINUTE": "3",
        **({"FORWARDED_ALLOW_IPS": trusted} if trusted else {}),
    }
    proc = spawn_cli("api", "--host", "127.0.0.1", "--port", str(port), **env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{base}/healthz", proc=proc)
        codes = [
            httpx.get(
                f"{base}/api/v1/jobs",
                headers={"Authorization": f"Bearer jp_wrong{n}", "X-Forwarded-For": f"10.0.0.{n}"},
                timeout=10,
            ).status_code
            for n in range(6)
        ]
    finally:
        stop_all([proc])
    # Untrusted: one client (this host) fails 3 times, then is throttled, whatever it says.
    # Trusted: six clients, one failure each.
    assert codes == ([401] * 6 if trusted else [401, 401, 401, 429, 429, 429])


async def _dev_api(
    pg_store: SqlStore, redis_bus: Bus, host: str
) -> AsyncIterator[tuple[AppClient, str]]:
    for spec in jobs_app.jobs.values():
        await pg_store.register_definition(spec.options, spec.args_schema(), "test")
    api = create_app(ApiSettings(auth_enabled=False, host=host), store=pg_store, bus=redis_bus)
    key = next(iter(jobs_app.jobs))
    async with api.router.lifespan_context(api), AppClient(api) as dev:
        yield dev, key


async def test_without_authentication_a_request_from_another_site_changes_nothing(
    pg_store: SqlStore, redis_bus: Bus
) -> None:
    """``jobplane dev``: a web page the developer visits could post a form to pause a job or
    cancel an instance (no body, no preflight): nothing told it from the api's own callers.
    A browser says where a request comes from; scripts say nothing and go on working."""
    async for dev, key in _dev_api(pg_store, redis_bus, "0.0.0.0"):
        pause = f"/api/v1/jobs/{key}/pause"
        for sent in (
            {"Origin": "https://evil.example"},
            {"Origin": "null"},
            {"Sec-Fetch-Site": "cross-site"},
            {"Sec-Fetch-Site": "same-site", "Origin": "http://api"},
        ):
            refused = await dev.post(pause, headers=sent)
            assert refused.status_code == 403, sent
            assert refused.headers["content-type"] == "application/problem+json"
            assert (await dev.get(f"/api/v1/jobs/{key}")).json()["paused"] is False
        # Reading is not refused; the api's own page, and a script, may change things.
        assert (await dev.get(pause.rsplit("/", 1)[0], headers=sent)).status_code == 200
        own = {"Origin": "http://api", "Sec-Fetch-Site": "same-origin"}
        assert (await dev.post(pause, headers=own)).status_code == 200
        assert (await dev.post(f"/api/v1/jobs/{key}/resume")).status_code == 200


async def test_without_authentication_on_a_loopback_address_only_loopback_names_are_served(
    pg_store: SqlStore, redis_bus: Bus
) -> None:
    """A page whose name its owner rebinds to 127.0.0.1 is, to the browser, of the same
    origin as the api: it could read everything and trigger at will. Its requests carry its
    own name in ``Host``, which a loopback address never answers to."""
    async for dev, _ in _dev_api(pg_store, redis_bus, "127.0.0.1"):
        for host in ("127.0.0.1:8000", "localhost:8000", "[::1]:8000", "127.0.0.2", "LOCALHOST"):
            answer = await dev.get("/api/v1/jobs", headers={"Host": host})
            assert answer.status_code == 200, host
        for host in ("evil.example:8000", "evil.example", "127.0.0.1.evil.example", ""):
            answer = await dev.get("/api/v1/jobs", headers={"Host": host})
            assert answer.status_code == 403, host


async def test_with_authentication_the_origin_is_not_checked(client: AppClient) -> None:
    """A bearer token is never sent by a browser on its own: no other site can act with it."""
    made = await client.get(
        "/api/v1/jobs", headers={"Origin": "https://elsewhere.example", "Host": "evil.example"}
    )
    assert made.status_code == 401  # the token is what counts
