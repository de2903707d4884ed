"""REST v1 over real stores and buses: every endpoint's success path and its errors."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from itertools import pairwise
from typing import Any
from uuid import UUID, uuid4

import httpx
import pytest

from jobplane.bus.abc import Bus
from jobplane.bus.factory import open_bus
from jobplane.domain.models import ErrorInfo, Outcome
from jobplane.domain.options import JobOptions
from jobplane.domain.states import InstanceState as S
from jobplane.store.factory import open_store
from jobplane.store.sql import SqlStore
from jobplane_api.main import create_app
from jobplane_api.settings import ApiSettings
from tests.apps.basic import app as jobs_app
from tests.cli_helpers import free_port
from tests.scheduler_helpers import running_scheduler, swept
from tests.worker_helpers import running_worker, wait_for

PROBLEM = "application/problem+json"


@pytest.fixture
async def api(store: SqlStore, bus: Bus) -> AsyncIterator[httpx.AsyncClient]:
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


def _problem(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith(PROBLEM)
    body: dict[str, Any] = response.json()
    assert body["status"] == status and body["title"]
    return body


async def test_list_and_get_jobs(api: httpx.AsyncClient) -> None:
    response = await api.get("/api/v1/jobs")
    assert response.status_code == 200
    keys = {j["key"] for j in response.json()}
    assert {"echo", "tick", "always_fails"} <= keys
    recurring = (await api.get("/api/v1/jobs", params={"kind": "recurring"})).json()
    assert [j["key"] for j in recurring] == ["tick"]
    assert (await api.get("/api/v1/jobs", params={"q": "ECHO"})).json()[0]["key"] == "echo"
    tick = (await api.get("/api/v1/jobs/tick")).json()
    assert len(tick["next_fire_times"]) == 10 and tick["version"] == 1
    echo = (await api.get("/api/v1/jobs/echo")).json()
    assert echo["args_schema"]["properties"]["value"]["type"] == "integer"
    _problem(await api.get("/api/v1/jobs/nope"), 404)


async def test_jobs_carry_outcome_success_rate_duration_and_next_fire(
    api: httpx.AsyncClient, store: SqlStore
) -> None:
    ids = []
    for value in range(2):
        created = await api.post("/api/v1/jobs/echo/instances", json={"args": {"value": value}})
        ids.append(UUID(created.json()["id"]))
    claimed = (await store.claim(ids, "w1", 30, ["echo"])).claimed
    await store.complete(
        [
            Outcome(c.instance.id, c.token, S.SUCCEEDED if n == 0 else S.CANCELLED)
            for n, c in enumerate(claimed)
        ]
    )
    jobs = {j["key"]: j for j in (await api.get("/api/v1/jobs")).json()}
    echo = jobs["echo"]
    assert echo["success_rate_24h"] == 0.5
    assert echo["last_outcome"]["state"] in ("succeeded", "cancelled")
    assert echo["last_outcome"]["ended_at"] is not None
    assert 0 <= echo["p95_duration_s_24h"] < 30
    assert echo["next_fire"] is None and echo["next_fire_times"] == []
    tick = jobs["tick"]
    assert tick["next_fire"] == tick["next_fire_times"][0]
    assert (tick["last_outcome"], tick["success_rate_24h"], tick["p95_duration_s_24h"]) == (
        None,
        None,
        None,
    )
    one = (await api.get("/api/v1/jobs/echo")).json()
    assert {k: one[k] for k in ("last_outcome", "success_rate_24h", "p95_duration_s_24h")} == {
        k: echo[k] for k in ("last_outcome", "success_rate_24h", "p95_duration_s_24h")
    }


async def test_edit_pause_resume(api: httpx.AsyncClient, bus: Bus) -> None:
    edited = await api.patch(
        "/api/v1/jobs/tick", json={"version": 1, "options": {"cron": "*/5 * * * *"}}
    )
    assert edited.status_code == 200, edited.text
    assert edited.json()["options"]["cron"] == "*/5 * * * *" and edited.json()["version"] == 2
    assert (await bus.get_pending_updates(["tick"])) == {"tick": 2}
    stale = await api.patch("/api/v1/jobs/tick", json={"version": 1, "options": {"retries": 1}})
    _problem(stale, 409)
    bad = await api.patch("/api/v1/jobs/tick", json={"version": 2, "options": {"cron": "nope"}})
    body = _problem(bad, 422)
    assert body["errors"] == [{"field": "cron", "reason": bad.json()["errors"][0]["reason"]}]
    immutable = await api.patch("/api/v1/jobs/tick", json={"version": 2, "options": {"key": "x"}})
    assert _problem(immutable, 422)["errors"][0]["field"] == "key"
    paused = (await api.post("/api/v1/jobs/tick/pause")).json()
    assert paused["paused"] and paused["next_fire_times"] == []
    resumed = (await api.post("/api/v1/jobs/tick/resume")).json()
    assert not resumed["paused"] and resumed["version"] == 4
    _problem(await api.post("/api/v1/jobs/nope/pause"), 404)


async def test_next_fire_times_keep_to_the_jobs_window(api: httpx.AsyncClient) -> None:
    """What the API shows is what the leader fires (tick: 12:00 in Berlin, 11:00 UTC in
    winter): nothing before start_at, nothing after end_at, and a start_at past the last tick
    before the year 10000 is the job's schedule error, not a list of times never fired."""

    async def edit(version: int, **options: str | None) -> dict[str, Any]:
        response = await api.patch(
            "/api/v1/jobs/tick", json={"version": version, "options": options}
        )
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    later = await edit(1, start_at="2030-01-01T00:00:00Z")
    assert later["next_fire_times"][:2] == ["2030-01-01T11:00:00Z", "2030-01-02T11:00:00Z"]
    assert len(later["next_fire_times"]) == 10 and later["schedule_error"] is None
    window = await edit(2, end_at="2030-01-03T11:00:00Z")  # inclusive, as the leader's
    assert [t[:10] for t in window["next_fire_times"]] == ["2030-01-01", "2030-01-02", "2030-01-03"]
    ended = await edit(3, start_at=None, end_at="2020-01-01T00:00:00Z")
    assert ended["next_fire"] is None and ended["next_fire_times"] == []
    assert ended["schedule_error"] is None
    beyond = await edit(4, start_at="9999-12-31T12:00:00Z", end_at=None)
    assert beyond["next_fire_times"] == [] and "before the year 10000" in beyond["schedule_error"]


async def test_version_history_and_rollback(api: httpx.AsyncClient, bus: Bus) -> None:
    await api.patch("/api/v1/jobs/tick", json={"version": 1, "options": {"cron": "*/5 * * * *"}})
    await api.post("/api/v1/jobs/tick/pause")
    versions = (await api.get("/api/v1/jobs/tick/versions")).json()
    assert [(v["version"], v["action"]) for v in versions] == [
        (3, "pause"),
        (2, "edit"),
        (1, "register"),
    ]
    assert versions[1]["options"]["cron"] == "*/5 * * * *" and versions[1]["actor"] == "api"
    assert versions[2]["options"]["cron"] == "0 12 * * *"

    rolled = await api.post("/api/v1/jobs/tick/rollback", json={"to_version": 1, "version": 3})
    assert rolled.status_code == 200, rolled.text
    body = rolled.json()
    assert body["version"] == 4 and body["options"]["cron"] == "0 12 * * *" and body["paused"]
    assert (await bus.get_pending_updates(["tick"])) == {"tick": 4}
    newest = (await api.get("/api/v1/jobs/tick/versions")).json()[0]
    assert (newest["version"], newest["action"], newest["rolled_back_to"]) == (4, "rollback", 1)

    stale = await api.post("/api/v1/jobs/tick/rollback", json={"to_version": 2, "version": 3})
    assert "at version 4" in str(_problem(stale, 409)["detail"])
    unknown = await api.post("/api/v1/jobs/tick/rollback", json={"to_version": 9, "version": 4})
    assert _problem(unknown, 404)["title"] == "Version not found"
    _problem(
        await api.post("/api/v1/jobs/nope/rollback", json={"to_version": 1, "version": 1}), 404
    )
    _problem(await api.get("/api/v1/jobs/nope/versions"), 404)
    _problem(
        await api.post("/api/v1/jobs/tick/rollback", json={"to_version": 0, "version": 4}), 422
    )
    huge = {"to_version": 2**40, "version": 4}
    _problem(await api.post("/api/v1/jobs/tick/rollback", json=huge), 422)
    assert len((await api.get("/api/v1/jobs/tick/versions")).json()) == 4


async def test_trigger_validates_arguments_and_replays_idempotency_keys(
    api: httpx.AsyncClient,
) -> None:
    created = await api.post("/api/v1/jobs/echo/instances", json={"args": {"value": 3}})
    assert created.status_code == 201, created.text
    assert created.json()["state"] == "enqueued" and created.json()["args"] == {"value": 3}
    bad = await api.post("/api/v1/jobs/echo/instances", json={"args": {"value": "three"}})
    assert _problem(bad, 422)["errors"][0]["field"] == "args.value"
    missing = await api.post("/api/v1/jobs/echo/instances", json={"args": {}})
    assert _problem(missing, 422)["errors"][0]["field"] == "args"
    _problem(await api.post("/api/v1/jobs/nope/instances", json={}), 404)
    _problem(await api.post("/api/v1/jobs/echo/instances", json={"priority": 99}), 422)
    _problem(await api.post("/api/v1/jobs/echo/instances", content=b"{not json"), 422)
    headers = {"Idempotency-Key": "order-1"}
    first = await api.post(
        "/api/v1/jobs/echo/instances", json={"args": {"value": 1}}, headers=headers
    )
    again = await api.post(
        "/api/v1/jobs/echo/instances", json={"args": {"value": 1}}, headers=headers
    )
    assert first.json()["id"] == again.json()["id"]
    delayed = await api.post(
        "/api/v1/jobs/echo/instances", json={"args": {"value": 1}, "delay_s": 3600}
    )
    assert delayed.json()["state"] == "scheduled"


async def test_idempotency_key_reused_with_a_different_request_is_409(
    api: httpx.AsyncClient,
) -> None:
    url = "/api/v1/jobs/echo/instances"
    headers = {"Idempotency-Key": "order-7"}
    request = {"args": {"value": 7}, "delay_s": 600, "priority": 3, "pinned_worker": "w-1"}
    first = await api.post(url, json=request, headers=headers)
    assert first.status_code == 201, first.text
    # A delayed trigger replayed later still matches: the delay is compared as given.
    again = await api.post(url, json=request, headers=headers)
    assert again.status_code == 201 and again.json()["id"] == first.json()["id"]
    assert again.json()["run_at"] == first.json()["run_at"]
    different = [
        (url, {**request, "args": {"value": 8}}),
        (url, {**request, "delay_s": 601}),
        (url, {**{k: v for k, v in request.items() if k != "delay_s"}, "run_at": _LATER}),
        (url, {**request, "priority": 4}),
        (url, {**request, "pinned_worker": "w-2"}),
        (url, {k: v for k, v in request.items() if k != "pinned_worker"}),
        ("/api/v1/jobs/tick/instances", {}),  # another job
    ]
    for target, body in different:
        problem = _problem(await api.post(target, json=body, headers=headers), 409)
        assert problem["title"] == "Idempotency-Key reused with a different request"
        assert "'order-7'" in str(problem["detail"]), problem
    listed = (await api.get("/api/v1/instances")).json()["items"]
    assert [i["id"] for i in listed] == [first.json()["id"]]


_LATER = "2030-01-01T00:00:00+00:00"


async def test_batch_items_carry_idempotency_keys(api: httpx.AsyncClient) -> None:
    url = "/api/v1/instances/batch"
    items = [
        {"job_key": "echo", "args": {"value": 1}, "idempotency_key": "b-1"},
        {"job_key": "echo", "args": {"value": 2}, "idempotency_key": "b-2", "run_at": _LATER},
        {"job_key": "echo", "args": {"value": 3}},
    ]
    first = await api.post(url, json={"items": items})
    assert first.status_code == 201, first.text
    assert [i["state"] for i in first.json()] == ["enqueued", "scheduled", "enqueued"]
    replay = (await api.post(url, json={"items": items[:2]})).json()
    assert [i["id"] for i in replay] == [i["id"] for i in first.json()[:2]]
    # A single trigger with the same key and request is the same request.
    single = await api.post(
        "/api/v1/jobs/echo/instances",
        json={"args": {"value": 1}},
        headers={"Idempotency-Key": "b-1"},
    )
    assert single.json()["id"] == first.json()[0]["id"]
    # One item reusing a key differently fails the batch: the new item is not created either.
    changed = [
        {"job_key": "echo", "args": {"value": 4}, "idempotency_key": "b-3"},
        {**items[1], "args": {"value": 5}},
    ]
    problem = _problem(await api.post(url, json={"items": changed}), 409)
    assert "'b-2'" in str(problem["detail"])
    same_key_twice = [items[0], {**items[0], "priority": 9}]
    _problem(await api.post(url, json={"items": same_key_twice}), 409)
    listed = (await api.get("/api/v1/instances", params={"limit": 10})).json()["items"]
    assert len(listed) == 3


async def test_batch_and_single_trigger_refuse_naive_run_at(api: httpx.AsyncClient) -> None:
    naive = "2030-01-01T00:00:00"
    single = await api.post(
        "/api/v1/jobs/echo/instances", json={"args": {"value": 1}, "run_at": naive}
    )
    assert _problem(single, 422)["errors"][0]["field"] == "body.run_at"
    items = [
        {"job_key": "echo", "args": {"value": 1}, "run_at": _LATER},
        {"job_key": "echo", "args": {"value": 2}, "run_at": naive},
    ]
    batch = await api.post("/api/v1/instances/batch", json={"items": items})
    assert _problem(batch, 422)["errors"][0]["field"] == "body.items.1.run_at"
    both = [{"job_key": "echo", "args": {"value": 1}, "run_at": _LATER, "delay_s": 5}]
    problem = _problem(await api.post("/api/v1/instances/batch", json={"items": both}), 422)
    assert problem["errors"] == [
        {"field": "items.0.delay_s", "reason": "give run_at or delay_s, not both"}
    ]
    assert (await api.get("/api/v1/instances")).json()["items"] == []


async def test_instance_detail_lists_attempts(api: httpx.AsyncClient, store: SqlStore) -> None:
    """Failed once, then succeeded: two attempts, the first with its outcome and reason, the
    second succeeded; the error the instance kept belongs to no attempt once it succeeded."""
    options = JobOptions.parse(key="flaky", kind="triggered", retries=1, backoff={"kind": "none"})
    await store.register_definition(options, None, "test")
    created = await api.post("/api/v1/jobs/flaky/instances", json={})
    instance_id = UUID(created.json()["id"])
    assert created.json()["attempts"] is None  # only the detail carries them
    [first] = (await store.claim([instance_id], "w-1", 30, ["flaky"])).claimed
    error = ErrorInfo("ValueError", "boom")
    await store.complete(
        [Outcome(instance_id, first.token, S.FAILED, error=error, reason="exception")]
    )
    failed = (await api.get(f"/api/v1/instances/{instance_id}")).json()
    assert failed["state"] == "enqueued"
    [one] = failed["attempts"]
    assert (one["number"], one["worker"], one["outcome"], one["reason"]) == (
        1,
        "w-1",
        "failed",
        "exception",
    )
    assert one["error"] == {"type": "ValueError", "message": "boom", "traceback": None}
    [second] = (await store.claim([instance_id], "w-2", 30, ["flaky"])).claimed
    running = (await api.get(f"/api/v1/instances/{instance_id}")).json()["attempts"]
    assert running[1]["worker"] == "w-2" and running[1]["ended_at"] is None
    assert running[1]["outcome"] is None and running[0]["error"]["message"] == "boom"
    await store.complete([Outcome(instance_id, second.token, S.SUCCEEDED, result=1)])
    done = (await api.get(f"/api/v1/instances/{instance_id}")).json()
    attempts = done["attempts"]
    assert [(a["number"], a["worker"], a["outcome"]) for a in attempts] == [
        (1, "w-1", "failed"),
        (2, "w-2", "succeeded"),
    ]
    by_seq = {t["to_state"]: t for t in done["transitions"]}
    assert attempts[1]["started_at"] < attempts[1]["ended_at"] == by_seq["succeeded"]["at"]
    assert attempts[0]["ended_at"] <= attempts[1]["started_at"]
    assert attempts[1]["error"] is None and done["error"] is None


async def test_body_limit_is_413(api: httpx.AsyncClient) -> None:
    big = {"args": {"value": 1, "padding": "x" * 10_000}}
    _problem(await api.post("/api/v1/jobs/echo/instances", json=big), 413)


async def test_nul_in_path_or_query_is_422(api: httpx.AsyncClient) -> None:
    """Postgres text cannot hold NUL: refused before the store sees it, never a 500."""
    for url in ("/api/v1/jobs/ec%00ho", "/api/v1/instances?job=e%00cho"):
        problem = _problem(await api.get(url), 422)
        assert problem["detail"] == "NUL characters are not allowed"


async def test_chunked_body_over_limit_is_413(api: httpx.AsyncClient) -> None:
    """No Content-Length: the limit is enforced on the bytes as they arrive."""

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"args": {"value": 1, "padding": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}}'

    headers = {"content-type": "application/json"}
    r = await api.post("/api/v1/jobs/echo/instances", content=chunks(), headers=headers)
    assert "content-length" not in r.request.headers
    problem = _problem(r, 413)
    assert problem["detail"] == "the limit is 4096 bytes"

    async def small() -> AsyncIterator[bytes]:
        yield b'{"args": {"value": 2}}'

    ok = await api.post("/api/v1/jobs/echo/instances", content=small(), headers=headers)
    assert ok.status_code == 201, ok.text


async def test_instances_list_get_cancel_retry(api: httpx.AsyncClient) -> None:
    ids = []
    for i in range(3):
        r = await api.post("/api/v1/jobs/echo/instances", json={"args": {"value": i}})
        ids.append(r.json()["id"])
    page = (await api.get("/api/v1/instances", params={"job": "echo", "limit": 2})).json()
    assert [i["id"] for i in page["items"]] == [ids[2], ids[1]]
    rest = (
        await api.get(
            "/api/v1/instances", params={"job": "echo", "limit": 2, "before": page["next_cursor"]}
        )
    ).json()
    assert [i["id"] for i in rest["items"]] == [ids[0]] and rest["next_cursor"] is None
    one = (await api.get(f"/api/v1/instances/{ids[0]}")).json()
    assert [t["to_state"] for t in one["transitions"]] == ["enqueued"]
    cancelled = await api.post(f"/api/v1/instances/{ids[0]}/cancel")
    assert cancelled.json()["state"] == "cancelled"
    _problem(await api.post(f"/api/v1/instances/{ids[0]}/cancel"), 409)
    retried = await api.post(f"/api/v1/instances/{ids[0]}/retry")
    assert retried.status_code == 201 and retried.json()["retry_of"] == ids[0]
    _problem(await api.post(f"/api/v1/instances/{ids[1]}/retry"), 409)  # not terminal
    _problem(await api.get(f"/api/v1/instances/{uuid4()}"), 404)
    _problem(await api.get("/api/v1/instances/not-a-uuid"), 422)
    states = (await api.get("/api/v1/instances", params={"state": ["cancelled"]})).json()
    assert [i["id"] for i in states["items"]] == [ids[0]]
    _problem(await api.get("/api/v1/instances", params={"state": ["bogus"]}), 422)


async def test_bulk_cancel_by_filter(api: httpx.AsyncClient, store: SqlStore, bus: Bus) -> None:
    ids = []
    for value in range(3):
        created = await api.post("/api/v1/jobs/echo/instances", json={"args": {"value": value}})
        ids.append(UUID(created.json()["id"]))
    other = (await api.post("/api/v1/jobs/tick/instances", json={})).json()["id"]
    [running] = (await store.claim([ids[0]], "w1", 30, ["echo"])).claimed
    done = await api.post("/api/v1/instances/cancel", json={"job": "echo"})
    assert done.status_code == 200, done.text
    body = done.json()
    assert (body["cancelled"], body["cancel_requested"], body["skipped"]) == (2, 1, 0)
    assert body["cancelled_ids"] == [str(ids[1]), str(ids[2])] and not body["more"]
    assert body["cancel_requested_ids"] == [str(running.instance.id)]
    assert (await store.get_instance(ids[0])).cancel_requested
    assert (await api.get(f"/api/v1/instances/{other}")).json()["state"] == "enqueued"

    terminal = await api.post(
        "/api/v1/instances/cancel", json={"job": "echo", "states": ["cancelled"]}
    )
    assert terminal.json()["skipped"] == 2 and terminal.json()["cancelled"] == 0
    # Oldest first: the running one (flagged again), and the tick instance is left for later.
    bounded = (await api.post("/api/v1/instances/cancel", json={"limit": 1})).json()
    assert (bounded["cancel_requested"], bounded["cancelled"], bounded["more"]) == (1, 0, True)
    _problem(await api.post("/api/v1/instances/cancel", json={"limit": 10_001}), 422)
    _problem(await api.post("/api/v1/instances/cancel", json={"state": "enqueued"}), 422)
    # A time without an offset is UTC; one that leaves years 1-9999 in UTC is refused.
    naive = await api.post("/api/v1/instances/cancel", json={"created_after": "2999-01-01"})
    assert naive.status_code == 200 and naive.json()["cancelled"] == 0
    low = {"created_after": "0001-01-01T00:00:00+01:00"}
    _problem(await api.post("/api/v1/instances/cancel", json=low), 422)


async def test_retry_with_an_idempotency_key_is_safe_to_replay(api: httpx.AsyncClient) -> None:
    ids = []
    for i in range(2):
        r = await api.post("/api/v1/jobs/echo/instances", json={"args": {"value": i}})
        ids.append(r.json()["id"])
        await api.post(f"/api/v1/instances/{ids[-1]}/cancel")
    key = {"Idempotency-Key": "retry-once"}
    first = await api.post(f"/api/v1/instances/{ids[0]}/retry", headers=key)
    again = await api.post(f"/api/v1/instances/{ids[0]}/retry", headers=key)
    assert first.status_code == 201 and again.status_code == 201
    assert again.json()["id"] == first.json()["id"] and first.json()["retry_of"] == ids[0]
    # The key names one request: a retry of another instance under it creates nothing.
    _problem(await api.post(f"/api/v1/instances/{ids[1]}/retry", headers=key), 409)
    trigger = {"args": {"value": 0}}
    _problem(await api.post("/api/v1/jobs/echo/instances", json=trigger, headers=key), 409)
    retries = (await api.get("/api/v1/instances", params={"job": "echo"})).json()["items"]
    assert [i["retry_of"] for i in retries if i["retry_of"]] == [ids[0]]
    # Without a key every POST is a new retry, as before.
    other = await api.post(f"/api/v1/instances/{ids[0]}/retry")
    assert other.status_code == 201 and other.json()["id"] != first.json()["id"]


async def test_bulk_retry_by_filter_links_and_is_safe_to_replay(
    api: httpx.AsyncClient, store: SqlStore
) -> None:
    ids = []
    for value in range(3):
        created = await api.post("/api/v1/jobs/echo/instances", json={"args": {"value": value}})
        ids.append(UUID(created.json()["id"]))
    claimed = {c.instance.id: c for c in (await store.claim(ids, "w1", 30, ["echo"])).claimed}
    await store.complete([Outcome(ids[0], claimed[ids[0]].token, S.FAILED)])  # → terminated
    await store.complete([Outcome(ids[1], claimed[ids[1]].token, S.SUCCEEDED)])

    default = (await api.post("/api/v1/instances/retry", json={"job": "echo"})).json()
    assert (default["retried"], default["skipped"], default["more"]) == (1, 0, False)
    [pair] = default["retries"]
    assert pair["instance_id"] == str(ids[0])
    new = (await api.get(f"/api/v1/instances/{pair['retry_id']}")).json()
    assert new["retry_of"] == str(ids[0]) and new["source"] == "retry"
    assert new["state"] == "enqueued" and new["args"] == {"value": 0}

    picked = {"job": "echo", "states": ["terminated", "succeeded", "processing"]}
    mixed = (await api.post("/api/v1/instances/retry", json=picked)).json()
    # ids[1] is retried; ids[0] was already (by the first call); ids[2] is still running.
    assert [p["instance_id"] for p in mixed["retries"]] == [str(ids[1])]
    assert sorted(mixed["skipped_ids"]) == sorted([str(ids[0]), str(ids[2])])
    replay = (await api.post("/api/v1/instances/retry", json=picked)).json()
    assert (replay["retried"], replay["skipped"]) == (0, 3)
    assert len((await api.get("/api/v1/instances", params={"job": "echo"})).json()["items"]) == 5

    await api.patch("/api/v1/jobs/echo", json={"version": 1, "options": {"disabled": True}})
    more = await api.post("/api/v1/jobs/echo/instances", json={"args": {"value": 9}})
    assert more.status_code == 409  # disabled
    disabled = (await api.post("/api/v1/instances/retry", json={"states": ["succeeded"]})).json()
    assert (disabled["retried"], disabled["skipped"]) == (0, 1)


async def test_batch_trigger_is_all_or_nothing(api: httpx.AsyncClient) -> None:
    items = [{"job_key": "echo", "args": {"value": i}} for i in range(5)]
    created = await api.post("/api/v1/instances/batch", json={"items": items})
    assert created.status_code == 201 and len(created.json()) == 5
    bad = [*items, {"job_key": "echo", "args": {"value": "x"}}]
    _problem(await api.post("/api/v1/instances/batch", json={"items": bad}), 422)
    stats = (await api.get("/api/v1/stats", params={"job": "echo"})).json()
    assert stats["by_state"] == {"enqueued": 5}
    assert len(stats["per_minute"]) == 60 and len(stats["per_hour"]) == 24


async def test_stats_count_ends_per_minute_and_per_hour(
    api: httpx.AsyncClient, store: SqlStore
) -> None:
    ids = []
    for value in range(3):
        created = await api.post("/api/v1/jobs/echo/instances", json={"args": {"value": value}})
        ids.append(UUID(created.json()["id"]))
    claimed = (await store.claim(ids, "w1", 30, ["echo"])).claimed
    states = [S.SUCCEEDED, S.SUCCEEDED, S.FAILED]
    await store.complete(
        [Outcome(c.instance.id, c.token, s) for c, s in zip(claimed, states, strict=True)]
    )
    stats = (await api.get("/api/v1/stats")).json()
    for series, width in (("per_minute", 60), ("per_hour", 3600)):
        buckets = stats[series]
        starts = [datetime.fromisoformat(b["start"]) for b in buckets]
        assert all((b - a).total_seconds() == width for a, b in pairwise(starts))
        assert sum(b["succeeded"] for b in buckets) == 2
        assert sum(b["failed"] for b in buckets) == 1
        assert (
            sum(b["terminated"] for b in buckets) == 1
        )  # echo has no retries: the failure ends it
    assert stats["by_state"] == {"succeeded": 2, "terminated": 1}


async def test_workers_scheduler_health_metrics(api: httpx.AsyncClient) -> None:
    assert (await api.get("/api/v1/workers")).json() == []
    assert (await api.get("/api/v1/scheduler")).json()["leader"] is None
    assert (await api.get("/healthz")).json() == {"status": "ok"}
    assert (await api.get("/readyz")).json() == {"status": "ready"}
    await api.post("/api/v1/jobs/echo/instances", json={"args": {"value": 1}})
    metrics = await api.get("/metrics")
    assert 'jobplane_instances{job="echo",state="enqueued"} 1.0' in metrics.text


async def test_openapi_documents_every_route(api: httpx.AsyncClient) -> None:
    spec = (await api.get("/openapi.json")).json()
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            assert operation.get("summary"), f"{method} {path} has no summary"
            assert operation.get("description"), f"{method} {path} has no description"
            if "requestBody" in operation:
                content = operation["requestBody"]["content"]["application/json"]
                assert content.get("example"), f"{method} {path} has no request example"


async def test_trigger_at_a_time_and_pinned_to_a_worker(
    api: httpx.AsyncClient, store: SqlStore
) -> None:
    url = "/api/v1/jobs/echo/instances"
    now = await store.now()
    later = (now + timedelta(hours=2)).isoformat()
    at = (await api.post(url, json={"args": {"value": 1}, "run_at": later})).json()
    assert at["state"] == "scheduled"
    assert datetime.fromisoformat(at["run_at"]) == now + timedelta(hours=2)
    past = (now - timedelta(minutes=1)).isoformat()
    due = (await api.post(url, json={"args": {"value": 2}, "run_at": past})).json()
    assert due["state"] == "enqueued"
    pinned = await api.post(url, json={"args": {"value": 3}, "pinned_worker": "w-only"})
    assert pinned.status_code == 201 and pinned.json()["pinned_worker"] == "w-only"
    stored = await store.get_instance(UUID(pinned.json()["id"]))
    assert stored.pinned_worker == "w-only"
    both = await api.post(url, json={"args": {"value": 4}, "run_at": later, "delay_s": 1})
    assert _problem(both, 422)["errors"] == [
        {"field": "delay_s", "reason": "give run_at or delay_s, not both"}
    ]
    too_long = await api.post(url, json={"args": {"value": 5}, "pinned_worker": "w" * 201})
    assert _problem(too_long, 422)["errors"][0]["field"] == "body.pinned_worker"


async def test_jobs_list_filters_by_queue_and_paused(
    api: httpx.AsyncClient, store: SqlStore
) -> None:
    options = JobOptions.parse(key="mailer", kind="triggered", queue="mail")
    await store.register_definition(options, None, "test")
    by_queue = (await api.get("/api/v1/jobs", params={"queue": "mail"})).json()
    assert [j["key"] for j in by_queue] == ["mailer"]
    assert (await api.get("/api/v1/jobs", params={"queue": "nowhere"})).json() == []
    assert (await api.get("/api/v1/jobs", params={"paused": "true"})).json() == []
    await api.post("/api/v1/jobs/tick/pause")
    paused = (await api.get("/api/v1/jobs", params={"paused": "true"})).json()
    assert [j["key"] for j in paused] == ["tick"]
    running = {j["key"] for j in (await api.get("/api/v1/jobs", params={"paused": "false"})).json()}
    assert "tick" not in running and {"echo", "mailer"} <= running
    both = await api.get("/api/v1/jobs", params={"paused": "false", "queue": "mail"})
    assert [j["key"] for j in both.json()] == ["mailer"]
    _problem(await api.get("/api/v1/jobs", params={"paused": "maybe"}), 422)


@pytest.mark.parametrize("down", ["postgres", "redis"])
async def test_readyz_is_503_when_a_backend_is_unreachable(
    down: str, pg_store: SqlStore, redis_bus: Bus
) -> None:
    closed = free_port()  # nothing listens there
    store, bus = pg_store, redis_bus
    if down == "postgres":
        store = open_store(f"postgresql://postgres@127.0.0.1:{closed}/jobplane")
    else:
        bus = open_bus(f"redis://127.0.0.1:{closed}/0", prefix="readyz-test")
    app = create_app(ApiSettings(auth_enabled=False), store=store, bus=bus)
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
                answer = await client.get("/readyz")
                problem = _problem(answer, 503)
                assert problem["title"] == "Not ready"
                # Open route: it says what is down, never where (host and port are logged).
                what = "database" if down == "postgres" else "redis"
                assert problem["detail"] == f"{what}: unavailable"
                assert str(closed) not in answer.text and "127.0.0.1" not in answer.text
                assert (await client.get("/healthz")).status_code == 200
    finally:
        await (store.close() if down == "postgres" else bus.close())


async def test_workers_list_what_a_running_worker_runs(
    api: httpx.AsyncClient, store: SqlStore, bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JOBPLANE_TEST_SLEEP_S", "30")
    async with running_worker(jobs_app, store, bus) as worker:
        made = (await api.post("/api/v1/jobs/sleepy/instances", json={})).json()
        later = {"args": {"value": 1}, "delay_s": 3600}
        idle = (await api.post("/api/v1/jobs/echo/instances", json=later)).json()

        async def running() -> bool:
            found = await store.get_instance(UUID(made["id"]))
            return found.state is S.PROCESSING

        await wait_for(running, what="the sleepy instance to run")
        [listed] = (await api.get("/api/v1/workers")).json()
        assert listed["id"] == worker.id and listed["stopped_at"] is None
        assert made["id"] in listed["running"] and idle["id"] not in listed["running"]
        await api.post(f"/api/v1/instances/{made['id']}/cancel")


async def test_hold_debug_mode_runs_triggered_jobs_only_by_hand(store: SqlStore, bus: Bus) -> None:
    for spec in jobs_app.jobs.values():
        await store.register_definition(spec.options, spec.args_schema(), "test")
    await store.register_definition(
        JobOptions.parse(key="tick", kind="recurring", cron="0 12 * * *"), None, "test"
    )
    settings = ApiSettings(auth_enabled=False, debug_hold_triggered=True)
    app = create_app(settings, store=store, bus=bus)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as api,
        running_worker(jobs_app, store, bus),
        running_scheduler(store, bus) as scheduler,
    ):
        key = {"Idempotency-Key": "held-1"}
        url = "/api/v1/jobs/echo/instances"
        held = (await api.post(url, json={"args": {"value": 3}}, headers=key)).json()
        assert held["state"] == "scheduled" and held["run_at"] is None
        replay = (await api.post(url, json={"args": {"value": 3}}, headers=key)).json()
        assert replay["id"] == held["id"]
        delayed = (await api.post(url, json={"args": {"value": 5}, "delay_s": 0.1})).json()
        assert delayed["state"] == "scheduled" and delayed["run_at"] is None  # held, not due
        batch = {"items": [{"job_key": "echo", "args": {"value": 4}}]}
        [batched] = (await api.post("/api/v1/instances/batch", json=batch)).json()
        assert batched["state"] == "scheduled" and batched["run_at"] is None
        # A hand trigger of a recurring job is already a run by hand: not held.
        tick = (await api.post("/api/v1/jobs/tick/instances", json={})).json()
        assert tick["state"] == "enqueued"
        await swept(scheduler)  # a worker runs, and the leader's sweeps pass them by
        assert (await store.get_instance(UUID(held["id"]))).state is S.SCHEDULED

        ran = await api.post(f"/api/v1/instances/{held['id']}/run")
        assert ran.status_code == 200 and ran.json()["state"] == "enqueued"

        async def succeeded() -> bool:
            return (await store.get_instance(UUID(held["id"]))).state is S.SUCCEEDED

        await wait_for(succeeded, what="the instance run by hand")
        assert (await store.get_instance(UUID(held["id"]))).result["value"] == 3
        transitions = (await api.get(f"/api/v1/instances/{held['id']}")).json()["transitions"]
        assert [t["to_state"] for t in transitions][:2] == ["scheduled", "enqueued"]
        assert transitions[1]["reason"] == "run by hand"
        for waiting in (batched, delayed):
            assert (await store.get_instance(UUID(waiting["id"]))).state is S.SCHEDULED
        # A retry of a terminal instance is asked for by hand: it is not held.
        retry = (await api.post(f"/api/v1/instances/{held['id']}/retry")).json()
        assert retry["state"] == "enqueued" and retry["retry_of"] == held["id"]
        _problem(await api.post(f"/api/v1/instances/{held['id']}/run"), 409)  # not Scheduled
        _problem(await api.post(f"/api/v1/instances/{uuid4()}/run"), 404)


async def test_run_now_starts_a_delayed_instance(api: httpx.AsyncClient) -> None:
    later = {"args": {"value": 1}, "delay_s": 3600}
    delayed = (await api.post("/api/v1/jobs/echo/instances", json=later)).json()
    assert delayed["state"] == "scheduled"
    ran = (await api.post(f"/api/v1/instances/{delayed['id']}/run")).json()
    assert ran["state"] == "enqueued"
    assert datetime.fromisoformat(ran["run_at"]) < datetime.fromisoformat(delayed["run_at"])
    cancelled = (await api.post(f"/api/v1/instances/{delayed['id']}/cancel")).json()
    assert cancelled["state"] == "cancelled"
    _problem(await api.post(f"/api/v1/instances/{delayed['id']}/run"), 409)
