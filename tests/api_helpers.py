"""One real app (Postgres database of its own, Redis key prefix of its own) shared by the many
requests of a test module: hundreds of cases cost one database, not one each."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI

from jobplane.bus.abc import Bus
from jobplane.bus.factory import open_bus
from jobplane.domain.options import JobOptions
from jobplane.store.factory import open_store
from jobplane.store.sql import SqlStore
from jobplane_api.main import create_app
from jobplane_api.settings import ApiSettings
from tests.apps.basic import app as jobs_app
from tests.fixtures.bus import delete_prefix
from tests.fixtures.store import admin, database_url_for


class AppClient(httpx.AsyncClient):
    """A client of ``app`` in-process (no server), which keeps the app at hand for the tests
    that read its route table or add a route."""

    def __init__(self, app: FastAPI) -> None:
        super().__init__(transport=httpx.ASGITransport(app=app), base_url="http://api")
        self.app = app


@dataclass
class LiveApi:
    client: AppClient
    store: SqlStore


@asynccontextmanager
async def live_api(
    postgres_url: str, template: str, redis_url: str, settings: ApiSettings
) -> AsyncIterator[LiveApi]:
    """The app over a new database made from the migrated ``template``, with the test jobs
    and a recurring job ``tick`` registered; everything is dropped afterwards."""
    name = f"jpapi_{uuid.uuid4().hex[:12]}"
    prefix = f"jptest-{uuid.uuid4().hex}"
    admin(postgres_url, f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    store = open_store(database_url_for(postgres_url, name))
    bus = open_bus(redis_url, prefix)
    try:
        for spec in jobs_app.jobs.values():
            await store.register_definition(spec.options, spec.args_schema(), "test")
        tick = JobOptions.parse(key="tick", kind="recurring", cron="0 12 * * *")
        await store.register_definition(tick, None, "test")
        app = create_app(settings, store=store, bus=bus)
        async with app.router.lifespan_context(app), AppClient(app) as client:
            yield LiveApi(client, store)
    finally:
        await bus.close()
        await store.close()
        await delete_prefix(redis_url, prefix)
        admin(postgres_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


PROBLEM = "application/problem+json"


def problem_of(response: httpx.Response, status: int) -> dict[str, Any]:
    """The problem+json body of ``response``, which must have ``status``."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith(PROBLEM)
    body: dict[str, Any] = response.json()
    assert body["status"] == status and body["title"]
    return body


@asynccontextmanager
async def api_over(store: SqlStore, bus: Bus) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the app over ``store`` and ``bus`` (authentication off, a 4 KiB body
    limit), in-process, with the test jobs and a recurring job ``tick`` registered."""
    for spec in jobs_app.jobs.values():
        await store.register_definition(spec.options, spec.args_schema(), "test")
    await store.register_definition(
        JobOptions.parse(key="tick", kind="recurring", cron="0 12 * * *", timezone="Europe/Berlin"),
        None,
        "test",
    )
    app = create_app(ApiSettings(auth_enabled=False, max_body_bytes=4096), store=store, bus=bus)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            yield client
