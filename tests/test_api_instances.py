"""REST v1 over real stores and buses: every endpoint's success path and its errors (instances,
operations, stats, workers and health; jobs and triggers in ``test_api.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from uuid import UUID, uuid4

import httpx
import pytest
from sqlalchemy import update

from jobplane.bus.abc import Bus
from jobplane.bus.factory import open_bus
from jobplane.domain.models import Outcome
from jobplane.domain.options import JobOptions
from jobplane.domain.states import InstanceState as S
from jobplane.store.factory import open_store
from jobplane.store.sql import SqlStore
from jobplane.store.tables import job_instances
from jobplane_api.main import create_app
from jobplane_api.settings import ApiSettings
from tests.api_helpers import api_over, problem_of
from tests.apps.basic import app as jobs_app
from tests.cli_helpers import free_port
from tests.scheduler_helpers import running_scheduler, swept
from tests.worker_helpers import running_worker, wait_for


@pytest.fixture
async def api(store: SqlStore, bus: Bus) -> AsyncIterator[httpx.AsyncClient]:
    async with api_over(store, bus) as client:
        yield client


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
    problem_of(await api.post(f"/api/v1/instances/{ids[0]}/cancel"), 409)
    retried = await api.post(f"/api/v1/instances/{ids[0]}/retry")
    assert retried.status_code == 201 and retried.json()["retry_of"] == ids[0]
    problem_of(await api.post(f"/api/v1/instances/{ids[1]}/retry"), 409)  # not terminal
    problem_of(await api.get(f"/api/v1/instances/{uuid4()}"), 404)
    problem_of(await api.get("/api/v1/instances/not-a-uuid"), 422)
    states = (await api.get("/api/v1/instances", params={"state": ["cancelled"]})).json()
    assert [i["id"] for i in states["items"]] == [ids[0]]
    problem_of(await api.get("/api/v1/instances", params={"state": ["bogus"]}), 422)


async def test_bulk_cancel_by_filter(api: httpx.AsyncClient, store: SqlStore, bus: Bus) -> None:
    ids = await _echoes(api, 3)
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

    # A state a cancel does not apply to selects nothing (it is not selected to be skipped).
    terminal = await api.post(
        "/api/v1/instances/cancel", json={"job": "echo", "states": ["cancelled"]}
    )
    assert terminal.json() | {"cancelled_ids": [], "skipped_ids": []} == {
        "cancelled": 0,
        "cancel_requested": 0,
        "skipped": 0,
        "more": False,
        "cancelled_ids": [],
        "cancel_requested_ids": [],
        "skipped_ids": [],
    }
    # Oldest first: the running one is told to stop already, so the tick instance is next.
    bounded = (await api.post("/api/v1/instances/cancel", json={"limit": 1})).json()
    assert bounded["cancelled_ids"] == [other] and bounded["cancel_requested"] == 0
    assert not bounded["more"]
    problem_of(await api.post("/api/v1/instances/cancel", json={"limit": 10_001}), 422)
    problem_of(await api.post("/api/v1/instances/cancel", json={"state": "enqueued"}), 422)
    # A time without an offset is UTC; one that leaves years 1-9999 in UTC is refused.
    naive = await api.post("/api/v1/instances/cancel", json={"created_after": "2999-01-01"})
    assert naive.status_code == 200 and naive.json()["cancelled"] == 0
    low = {"created_after": "0001-01-01T00:00:00+01:00"}
    problem_of(await api.post("/api/v1/instances/cancel", json=low), 422)


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
    problem_of(await api.post(f"/api/v1/instances/{ids[1]}/retry", headers=key), 409)
    trigger = {"args": {"value": 0}}
    problem_of(await api.post("/api/v1/jobs/echo/instances", json=trigger, headers=key), 409)
    retries = (await api.get("/api/v1/instances", params={"job": "echo"})).json()["items"]
    assert [i["retry_of"] for i in retries if i["retry_of"]] == [ids[0]]
    # Without a key every POST is a new retry, as before.
    other = await api.post(f"/api/v1/instances/{ids[0]}/retry")
    assert other.status_code == 201 and other.json()["id"] != first.json()["id"]


async def test_a_retry_replayed_after_retention_deleted_its_instance_answers_the_retry(
    api: httpx.AsyncClient, store: SqlStore
) -> None:
    """The answer to a keyed retry was lost, and retention deleted the retried instance before
    the client replayed the request: the replay answered 404, though its retry runs."""
    old = (await api.post("/api/v1/jobs/echo/instances", json={"args": {"value": 1}})).json()
    await api.post(f"/api/v1/instances/{old['id']}/cancel")
    key = {"Idempotency-Key": "retry-late"}
    first = await api.post(f"/api/v1/instances/{old['id']}/retry", headers=key)
    async with store.engine.begin() as conn:
        long_ago = datetime.now(UTC) - timedelta(days=30)
        await conn.execute(
            update(job_instances)
            .where(job_instances.c.id == UUID(old["id"]))
            .values(finished_at=long_ago)
        )
    lease = await store.acquire_leadership(0, "leader", 30)
    assert lease is not None
    assert await store.delete_finished_before(long_ago + timedelta(days=1), fence=lease) == 1
    again = await api.post(f"/api/v1/instances/{old['id']}/retry", headers=key)
    assert again.status_code == 201 and again.json()["id"] == first.json()["id"]
    problem_of(await api.post(f"/api/v1/instances/{old['id']}/retry"), 404)  # no key: gone


async def test_bulk_retry_by_filter_links_and_is_safe_to_replay(
    api: httpx.AsyncClient, store: SqlStore
) -> None:
    ids = await _echoes(api, 3)
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
    # ids[1] is retried; ids[0] was already (by the first call) and ids[2] is still running:
    # neither is selected.
    assert [p["instance_id"] for p in mixed["retries"]] == [str(ids[1])]
    assert (mixed["skipped"], mixed["more"], mixed["next_cursor"]) == (0, False, None)
    replay = (await api.post("/api/v1/instances/retry", json=picked)).json()
    assert (replay["retried"], replay["skipped"], replay["more"]) == (0, 0, False)
    assert len((await api.get("/api/v1/instances", params={"job": "echo"})).json()["items"]) == 5
    running = {"job": "echo", "states": ["processing"]}
    assert (await api.post("/api/v1/instances/retry", json=running)).json()["retried"] == 0

    await api.patch("/api/v1/jobs/echo", json={"version": 1, "options": {"disabled": True}})
    more = await api.post("/api/v1/jobs/echo/instances", json={"args": {"value": 9}})
    assert more.status_code == 409  # disabled
    cancelled = await api.post("/api/v1/instances/cancel", json={"job": "echo"})
    assert cancelled.json()["cancel_requested"] == 1  # ids[2]; the retries are cancelled
    disabled = (await api.post("/api/v1/instances/retry", json={"states": ["cancelled"]})).json()
    assert (disabled["retried"], disabled["skipped"]) == (0, 2)


async def test_bulk_retry_called_again_goes_on_to_the_rest(api: httpx.AsyncClient) -> None:
    """A bulk retry selected the newest ``limit`` instances at every call, each skipped as
    already retried from the second call on, while ``more`` said to call again: the ones after
    them were never retried."""
    ids = await _echoes(api, 5)
    assert (await api.post("/api/v1/instances/cancel", json={"job": "echo"})).json()[
        "cancelled"
    ] == 5
    retried: list[str] = []
    for _ in range(5):
        body = {"job": "echo", "states": ["cancelled"], "limit": 2}
        call = (await api.post("/api/v1/instances/retry", json=body)).json()
        retried += [p["instance_id"] for p in call["retries"]]
        assert call["skipped"] == 0
        if not call["more"]:
            break
    # Newest first, every one of them once, in three calls.
    assert retried == [str(i) for i in sorted(ids, reverse=True)]
    assert call["more"] is False and call["next_cursor"] is None


async def test_bulk_retry_goes_on_past_instances_skipped_for_good_with_the_cursor(
    api: httpx.AsyncClient, store: SqlStore
) -> None:
    """Instances a retry skips for good (their arguments no longer valid for the job) are
    selected again by a call from the newest; ``next_cursor`` passed as ``before`` goes on."""
    ids = await _echoes(api, 3)
    assert (await api.post("/api/v1/instances/cancel", json={"job": "echo"})).json()[
        "cancelled"
    ] == 3
    async with store.engine.begin() as conn:  # the two newest carry arguments now refused
        await conn.execute(
            update(job_instances).where(job_instances.c.id.in_(ids[1:])).values(args={"value": "x"})
        )
    body = {"job": "echo", "states": ["cancelled"], "limit": 2}
    first = (await api.post("/api/v1/instances/retry", json=body)).json()
    assert (first["retried"], first["skipped"], first["more"]) == (0, 2, True)
    on = body | {"before": first["next_cursor"]}
    after = (await api.post("/api/v1/instances/retry", json=on)).json()
    assert [p["instance_id"] for p in after["retries"]] == [str(ids[0])] and not after["more"]
    problem_of(await api.post("/api/v1/instances/retry", json=body | {"before": "x"}), 422)


async def test_batch_trigger_is_all_or_nothing(api: httpx.AsyncClient) -> None:
    items = [{"job_key": "echo", "args": {"value": i}} for i in range(5)]
    created = await api.post("/api/v1/instances/batch", json={"items": items})
    assert created.status_code == 201 and len(created.json()) == 5
    bad = [*items, {"job_key": "echo", "args": {"value": "x"}}]
    problem_of(await api.post("/api/v1/instances/batch", json={"items": bad}), 422)
    stats = (await api.get("/api/v1/stats", params={"job": "echo"})).json()
    assert stats["by_state"] == {"enqueued": 5}
    assert len(stats["per_minute"]) == 60 and len(stats["per_hour"]) == 24


async def test_stats_count_ends_per_minute_and_per_hour(
    api: httpx.AsyncClient, store: SqlStore
) -> None:
    ids = await _echoes(api, 3)
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
    assert problem_of(both, 422)["errors"] == [
        {"field": "delay_s", "reason": "give run_at or delay_s, not both"}
    ]
    too_long = await api.post(url, json={"args": {"value": 5}, "pinned_worker": "w" * 201})
    assert problem_of(too_long, 422)["errors"][0]["field"] == "body.pinned_worker"


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
    problem_of(await api.get("/api/v1/jobs", params={"paused": "maybe"}), 422)


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
                problem = problem_of(answer, 503)
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
        problem_of(await api.post(f"/api/v1/instances/{held['id']}/run"), 409)  # not Scheduled
        problem_of(await api.post(f"/api/v1/instances/{uuid4()}/run"), 404)


async def test_run_now_starts_a_delayed_instance(api: httpx.AsyncClient) -> None:
    later = {"args": {"value": 1}, "delay_s": 3600}
    delayed = (await api.post("/api/v1/jobs/echo/instances", json=later)).json()
    assert delayed["state"] == "scheduled"
    ran = (await api.post(f"/api/v1/instances/{delayed['id']}/run")).json()
    assert ran["state"] == "enqueued"
    assert datetime.fromisoformat(ran["run_at"]) < datetime.fromisoformat(delayed["run_at"])
    cancelled = (await api.post(f"/api/v1/instances/{delayed['id']}/cancel")).json()
    assert cancelled["state"] == "cancelled"
    problem_of(await api.post(f"/api/v1/instances/{delayed['id']}/run"), 409)


async def _echoes(api: httpx.AsyncClient, count: int) -> list[UUID]:
    """Trigger ``echo`` ``count`` times (values 0, 1, …); the instances' ids."""
    ids = []
    for value in range(count):
        created = await api.post("/api/v1/jobs/echo/instances", json={"args": {"value": value}})
        ids.append(UUID(created.json()["id"]))
    return ids
