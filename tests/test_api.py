"""REST v1 over real stores and buses: every endpoint's success path and its errors (jobs,
triggers and limits here; instances, operations and the rest in ``test_api_instances.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any
from uuid import UUID

import httpx
import pytest

from jobplane.bus.abc import Bus
from jobplane.domain.models import ErrorInfo, Outcome
from jobplane.domain.options import JobOptions
from jobplane.domain.states import InstanceState as S
from jobplane.store.sql import SqlStore
from tests.api_helpers import api_over, problem_of


@pytest.fixture
async def api(store: SqlStore, bus: Bus) -> AsyncIterator[httpx.AsyncClient]:
    async with api_over(store, bus) as client:
        yield client


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
    problem_of(await api.get("/api/v1/jobs/nope"), 404)


async def test_jobs_count_the_live_workers_that_can_run_them(
    api: httpx.AsyncClient, store: SqlStore
) -> None:
    """``runners``: live workers that registered the job and consume its queue. A worker of
    another queue, or one stopped, does not count; an edit of the queue is followed."""
    from jobplane.domain.models import WorkerInfo

    assert (await api.get("/api/v1/jobs/echo")).json()["runners"] == 0
    pools = {"w-cpu": ("default",), "w-gpu": ("gpu",), "w-old": ("default",)}
    for worker, queues in pools.items():
        await store.register_worker(WorkerInfo(worker, "h", 1, queues, 4, "1", ("echo",)))
    await store.worker_stopped("w-old")
    jobs = {j["key"]: j for j in (await api.get("/api/v1/jobs")).json()}
    assert jobs["echo"]["runners"] == 1  # w-cpu: w-gpu consumes another queue, w-old stopped
    assert jobs["tick"]["runners"] == 0  # no worker registered it

    version = jobs["echo"]["version"]
    edited = await api.patch(
        "/api/v1/jobs/echo", json={"version": version, "options": {"queue": "gpu"}}
    )
    assert edited.status_code == 200 and edited.json()["runners"] == 1  # w-gpu now
    moved = await api.patch(
        "/api/v1/jobs/echo", json={"version": version + 1, "options": {"queue": "mail"}}
    )
    assert moved.json()["runners"] == 0


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
    problem_of(stale, 409)
    bad = await api.patch("/api/v1/jobs/tick", json={"version": 2, "options": {"cron": "nope"}})
    body = problem_of(bad, 422)
    assert body["errors"] == [{"field": "cron", "reason": bad.json()["errors"][0]["reason"]}]
    immutable = await api.patch("/api/v1/jobs/tick", json={"version": 2, "options": {"key": "x"}})
    assert problem_of(immutable, 422)["errors"][0]["field"] == "key"
    paused = (await api.post("/api/v1/jobs/tick/pause")).json()
    assert paused["paused"] and paused["next_fire_times"] == []
    resumed = (await api.post("/api/v1/jobs/tick/resume")).json()
    assert not resumed["paused"] and resumed["version"] == 4
    problem_of(await api.post("/api/v1/jobs/nope/pause"), 404)


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
    assert "at version 4" in str(problem_of(stale, 409)["detail"])
    unknown = await api.post("/api/v1/jobs/tick/rollback", json={"to_version": 9, "version": 4})
    assert problem_of(unknown, 404)["title"] == "Version not found"
    problem_of(
        await api.post("/api/v1/jobs/nope/rollback", json={"to_version": 1, "version": 1}), 404
    )
    problem_of(await api.get("/api/v1/jobs/nope/versions"), 404)
    problem_of(
        await api.post("/api/v1/jobs/tick/rollback", json={"to_version": 0, "version": 4}), 422
    )
    huge = {"to_version": 2**40, "version": 4}
    problem_of(await api.post("/api/v1/jobs/tick/rollback", json=huge), 422)
    assert len((await api.get("/api/v1/jobs/tick/versions")).json()) == 4


async def test_trigger_validates_arguments_and_replays_idempotency_keys(
    api: httpx.AsyncClient,
) -> None:
    created = await api.post("/api/v1/jobs/echo/instances", json={"args": {"value": 3}})
    assert created.status_code == 201, created.text
    assert created.json()["state"] == "enqueued" and created.json()["args"] == {"value": 3}
    bad = await api.post("/api/v1/jobs/echo/instances", json={"args": {"value": "three"}})
    assert problem_of(bad, 422)["errors"][0]["field"] == "args.value"
    missing = await api.post("/api/v1/jobs/echo/instances", json={"args": {}})
    assert problem_of(missing, 422)["errors"][0]["field"] == "args"
    problem_of(await api.post("/api/v1/jobs/nope/instances", json={}), 404)
    problem_of(await api.post("/api/v1/jobs/echo/instances", json={"priority": 99}), 422)
    problem_of(await api.post("/api/v1/jobs/echo/instances", content=b"{not json"), 422)
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
        problem = problem_of(await api.post(target, json=body, headers=headers), 409)
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
    problem = problem_of(await api.post(url, json={"items": changed}), 409)
    assert "'b-2'" in str(problem["detail"])
    same_key_twice = [items[0], {**items[0], "priority": 9}]
    problem_of(await api.post(url, json={"items": same_key_twice}), 409)
    listed = (await api.get("/api/v1/instances", params={"limit": 10})).json()["items"]
    assert len(listed) == 3


async def test_batch_and_single_trigger_refuse_naive_run_at(api: httpx.AsyncClient) -> None:
    naive = "2030-01-01T00:00:00"
    single = await api.post(
        "/api/v1/jobs/echo/instances", json={"args": {"value": 1}, "run_at": naive}
    )
    assert problem_of(single, 422)["errors"][0]["field"] == "body.run_at"
    items = [
        {"job_key": "echo", "args": {"value": 1}, "run_at": _LATER},
        {"job_key": "echo", "args": {"value": 2}, "run_at": naive},
    ]
    batch = await api.post("/api/v1/instances/batch", json={"items": items})
    assert problem_of(batch, 422)["errors"][0]["field"] == "body.items.1.run_at"
    both = [{"job_key": "echo", "args": {"value": 1}, "run_at": _LATER, "delay_s": 5}]
    problem = problem_of(await api.post("/api/v1/instances/batch", json={"items": both}), 422)
    assert problem["errors"] == [
        {"field": "items.0.delay_s", "reason": "give run_at or delay_s, not both"}
    ]
    assert (await api.get("/api/v1/instances")).json()["items"] == []


async def test_a_batch_refusal_names_the_item(api: httpx.AsyncClient) -> None:
    """An item's arguments the job's schema refuses were named "args.value", whichever item
    it was (three hundred, say): the field is the body's now, ``items.<n>.args…``."""
    url = "/api/v1/instances/batch"
    good = {"job_key": "echo", "args": {"value": 1}}
    bad = {"job_key": "echo", "args": {"value": "y"}}
    for items, field in (([good, good, bad], "items.2.args.value"), ([bad], "items.0.args.value")):
        problem = problem_of(await api.post(url, json={"items": items}), 422)
        [error] = problem["errors"]
        assert error["field"] == field, problem
    assert (await api.get("/api/v1/instances")).json()["items"] == []


@pytest.mark.parametrize("number", [253402300799, 1700000000, 1.5, "1700000000"])
async def test_a_time_given_as_a_number_is_refused_naming_its_field(
    api: httpx.AsyncClient, number: object
) -> None:
    """Read as Unix seconds, or as milliseconds once above 2e10: 253402300799 (9999, in
    seconds) became a day of 1978."""
    sent = await api.post(
        "/api/v1/jobs/echo/instances", json={"args": {"value": 1}, "run_at": number}
    )
    [error] = problem_of(sent, 422)["errors"]
    assert error["field"] == "body.run_at" and "ISO 8601" in error["reason"]
    listed = await api.get("/api/v1/instances", params={"created_after": str(number)})
    assert problem_of(listed, 422)["errors"][0]["field"] == "query.created_after"
    edit = {"version": 1, "options": {"start_at": number}}
    edited = await api.patch("/api/v1/jobs/tick", json=edit)
    assert problem_of(edited, 422)["errors"][0]["field"] in ("start_at", "body.options.start_at")
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
    problem_of(await api.post("/api/v1/jobs/echo/instances", json=big), 413)


async def test_nul_in_path_or_query_is_422(api: httpx.AsyncClient) -> None:
    """Postgres text cannot hold NUL: refused before the store sees it, never a 500."""
    for url in ("/api/v1/jobs/ec%00ho", "/api/v1/instances?job=e%00cho"):
        problem = problem_of(await api.get(url), 422)
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
    problem = problem_of(r, 413)
    assert problem["detail"] == "the limit is 4096 bytes"

    async def small() -> AsyncIterator[bytes]:
        yield b'{"args": {"value": 2}}'

    ok = await api.post("/api/v1/jobs/echo/instances", content=small(), headers=headers)
    assert ok.status_code == 201, ok.text
