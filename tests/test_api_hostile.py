"""Hostile and careless input against the real app on Postgres and Redis: every bad value is
a 4xx problem naming its field, never a 5xx, and whatever is accepted can be read back."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any
from uuid import uuid4

import httpx
import pytest
import pytest_asyncio

from jobplane.client import AsyncClient
from jobplane.domain.limits import MAX_JSON_DEPTH, check_json
from jobplane.enqueue import enqueue_async
from jobplane.errors import InvalidOptionsError
from jobplane_api.settings import ApiSettings
from tests.api_helpers import LiveApi, live_api

LOW = "0001-01-01T00:00:00+01:00"  # before year 1 in UTC
HIGH = "9999-12-31T23:59:59-01:00"  # after year 9999 in UTC
FILTERS = ("created_after", "created_before", "scheduled_after", "scheduled_before")
FREE = "sleepy"  # a job without an argument model: any JSON is valid for it


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def raw(body: str) -> dict[str, Any]:
    """A body sent as it is (NaN, 1e400 and lone surrogates cannot go through ``json=``)."""
    return {"content": body.encode(), "headers": {"content-type": "application/json"}}


def case(
    name: str, method: str, path: str, status: int, field: str | None = None, **request: Any
) -> Any:
    return pytest.param(method, path, request, status, field, id=name)


QUERY_TIMES = [
    case(f"{f}-{label}", "GET", "/api/v1/instances", status, f"query.{f}" if field else None,
         params={f: value})
    for f in FILTERS
    for label, value, status, field in (
        ("naive-is-utc", "2026-01-01T00:00:00", 200, False),
        ("date-only", "2026-01-01", 200, False),
        ("before-year-1", LOW, 422, True),
        ("after-year-9999", HIGH, 422, True),
        ("not-a-date", "2026-13-45", 422, True),
    )
]  # fmt: skip

BODY_TIMES = [
    case(f"bulk-{op}-{f}-{label}", "POST", f"/api/v1/instances/{op}", status,
         f"body.{f}" if status == 422 else None, json={"job": "echo", f: value})
    for op in ("cancel", "retry")
    for f in FILTERS
    for label, value, status in (("naive", "2026-01-01T00:00:00", 200), ("low", LOW, 422),
                                 ("high", HIGH, 422))
] + [
    case(f"run_at-{label}", "POST", f"/api/v1/jobs/{FREE}/instances", 422, "body.run_at",
         json={"run_at": value})
    for label, value in (("low", LOW), ("high", HIGH), ("naive", "2026-01-01T00:00:00"))
] + [
    case(f"batch-run_at-{label}", "POST", "/api/v1/instances/batch", 422, "body.items.0.run_at",
         json={"items": [{"job_key": FREE, "run_at": value}]})
    for label, value in (("low", LOW), ("high", HIGH), ("naive", "2026-01-01T00:00:00"))
] + [
    case(f"start_at-{label}", "PATCH", "/api/v1/jobs/tick", 422, "start_at",
         json={"version": 1, "options": {"start_at": value}})
    for label, value in (("low", LOW), ("naive", "2026-01-01T00:00:00"))
]  # fmt: skip

ZONES = [
    case(f"timezone-{label}", "PATCH", "/api/v1/jobs/tick", 422, "timezone",
         json={"version": 1, "options": {"timezone": value}})
    for label, value in (("5000-chars", "A" * 5000), ("path", "../../etc/passwd"),
                         ("nul", "Europe/Berlin\x00"), ("unknown", "Mars/Olympus"))
]  # fmt: skip

NUL = "a\x00b"
DATABASE_REFUSALS = [
    case("nul-token-name", "POST", "/api/v1/tokens", 422, "body.name",
         json={"name": NUL, "role": "viewer"}),
    case("surrogate-token-name", "POST", "/api/v1/tokens", 422, "body.name",
         **raw('{"name": "x\\ud800", "role": "viewer"}')),
    case("nul-pinned-worker", "POST", f"/api/v1/jobs/{FREE}/instances", 422,
         "body.pinned_worker", json={"pinned_worker": NUL}),
    case("nul-batch-job-key", "POST", "/api/v1/instances/batch", 422, "body.items.0.job_key",
         json={"items": [{"job_key": NUL}]}),
    case("nul-batch-idempotency-key", "POST", "/api/v1/instances/batch", 422,
         "body.items.0.idempotency_key", json={"items": [{"job_key": FREE,
                                                          "idempotency_key": NUL}]}),
    case("nul-bulk-job", "POST", "/api/v1/instances/cancel", 422, "body.job",
         json={"job": NUL}),
    case("nul-description", "PATCH", "/api/v1/jobs/tick", 422, "description",
         json={"version": 1, "options": {"description": NUL}}),
    case("huge-description", "PATCH", "/api/v1/jobs/tick", 422, "description",
         json={"version": 1, "options": {"description": "d" * 5000}}),
    case("huge-name", "PATCH", "/api/v1/jobs/tick", 422, "name",
         json={"version": 1, "options": {"name": "n" * 201}}),
] + [
    case(f"args-{label}", "POST", f"/api/v1/jobs/{FREE}/instances", 422, "body.args",
         **raw(f'{{"args": {body}}}'))
    for label, body in (("nan", "NaN"), ("infinity", "Infinity"), ("minus-infinity", "-Infinity"),
                        ("1e400", "1e400"), ("nested-nan", '{"a": [1, NaN]}'),
                        ("lone-surrogate", '"\\udc00"'), ("nul", '{"a": "\\u0000"}'),
                        ("nul-in-key", '{"\\u0000": 1}'),
                        ("surrogate-in-key", '{"\\ud800": 1}'))
] + [
    case("batch-args-nan", "POST", "/api/v1/instances/batch", 422, "body.items.0.args",
         **raw(f'{{"items": [{{"job_key": "{FREE}", "args": NaN}}]}}')),
    case("delay-nan", "POST", f"/api/v1/jobs/{FREE}/instances", 422, "body.delay_s",
         **raw('{"delay_s": NaN}')),
] + [
    case(f"{option}-{label}", "PATCH", "/api/v1/jobs/tick", 422, option,
         **raw(f'{{"version": 1, "options": {{"{option}": {value}}}}}'))
    for option in ("max_concurrency", "retries", "max_unexpected_retries", "misfire_max")
    for label, value in (("2^31", 2**31), ("2^63", 2**63))
] + [
    case("misfire_max-over-its-bound", "PATCH", "/api/v1/jobs/tick", 422, "misfire_max",
         **raw('{"version": 1, "options": {"misfire_max": 10001}}')),
] + [
    case(f"timeout_s-{label}", "PATCH", "/api/v1/jobs/tick", 422, "timeout_s",
         **raw(f'{{"version": 1, "options": {{"timeout_s": {value}}}}}'))
    for label, value in (("infinity", "Infinity"), ("nan", "NaN"), ("1e400", "1e400"))
]  # fmt: skip

NESTING = [
    case(f"args-depth-{depth}", "POST", f"/api/v1/jobs/{FREE}/instances", 422, "body.args",
         json={"args": nested(depth)})
    for depth in (MAX_JSON_DEPTH + 1, 256, 300)
] + [
    case("batch-args-depth-300", "POST", "/api/v1/instances/batch", 422, "body.items.0.args",
         json={"items": [{"job_key": FREE, "args": nested(300)}]}),
    # Deeper than the JSON parser goes: refused as unreadable, never a 500.
    case("args-depth-5000", "POST", f"/api/v1/jobs/{FREE}/instances", 400,
         **raw('{"args": ' + "[" * 5000 + "]" * 5000 + "}")),
]  # fmt: skip

RESERVED = "retry-of:" + str(uuid4())
KEYS = [
    case("header-reserved", "POST", f"/api/v1/jobs/{FREE}/instances", 422,
         "header.idempotency-key", json={}, headers={"Idempotency-Key": RESERVED}),
    case("header-empty", "POST", f"/api/v1/jobs/{FREE}/instances", 422,
         "header.idempotency-key", json={}, headers={"Idempotency-Key": ""}),
    case("header-blank", "POST", f"/api/v1/jobs/{FREE}/instances", 422,
         "header.idempotency-key", json={}, headers={"Idempotency-Key": "   "}),
    case("header-too-long", "POST", f"/api/v1/jobs/{FREE}/instances", 422,
         "header.idempotency-key", json={}, headers={"Idempotency-Key": "k" * 201}),
    case("retry-header-reserved", "POST", f"/api/v1/instances/{uuid4()}/retry", 422,
         "header.idempotency-key", headers={"Idempotency-Key": RESERVED}),
    case("batch-reserved", "POST", "/api/v1/instances/batch", 422,
         "body.items.0.idempotency_key",
         json={"items": [{"job_key": FREE, "idempotency_key": RESERVED}]}),
    case("batch-empty", "POST", "/api/v1/instances/batch", 422,
         "body.items.0.idempotency_key",
         json={"items": [{"job_key": FREE, "idempotency_key": ""}]}),
]  # fmt: skip

HOSTILE = QUERY_TIMES + BODY_TIMES + ZONES + DATABASE_REFUSALS + NESTING + KEYS


# One app for the whole module (hundreds of cases); each test that writes uses its own job.
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def live(postgres_url: str, pg_template: str, redis_url: str) -> AsyncIterator[LiveApi]:
    async with live_api(
        postgres_url, pg_template, redis_url, ApiSettings(auth_enabled=False)
    ) as found:
        yield found


@pytest.fixture
def api(live: LiveApi) -> httpx.AsyncClient:
    return live.client


@pytest.mark.parametrize(("method", "path", "request_", "status", "field"), HOSTILE)
async def test_hostile_input_is_a_clear_4xx(
    api: httpx.AsyncClient,
    method: str,
    path: str,
    request_: dict[str, Any],
    status: int,
    field: str | None,
) -> None:
    response = await api.request(method, path, **request_)
    assert response.status_code == status, response.text
    if status >= 400:
        assert response.headers["content-type"].startswith("application/problem+json")
        body = response.json()
        assert "asyncpg" not in response.text and "query argument" not in response.text
    if field is not None:
        fields = [e["field"] for e in body["errors"]]
        assert any(f == field or f.startswith(field + ".") for f in fields), body


async def test_a_content_length_that_is_not_ascii_digits_is_413(api: httpx.AsyncClient) -> None:
    """Header values are read as Latin-1: "²" (0xB2) passes ``str.isdigit`` and not ``int``,
    and 5,000 nines pass it and are over ``int``'s limit (both were a ValueError: a 500)."""
    url = f"/api/v1/jobs/{FREE}/instances"
    for length in (b"\xb2", b"\xb9", b"9" * 5000, b"9" * 21, b"-2", b"1e3", b""):
        headers = {b"content-type": b"application/json", b"content-length": length}
        response = await api.post(url, content=b"{}", headers=headers)
        assert response.status_code == 413, (length[:10], response.text)
        assert response.headers["content-type"].startswith("application/problem+json")
    headers = {b"content-type": b"application/json", b"content-length": b"0002"}
    assert (await api.post(url, content=b"{}", headers=headers)).status_code == 201


async def test_arguments_at_the_depth_limit_are_stored_and_read_back(
    api: httpx.AsyncClient,
) -> None:
    # The deepest accepted arguments, inside a page of instances: every read path answers.
    args = {"deep": nested(MAX_JSON_DEPTH - 1)}
    created = await api.post("/api/v1/jobs/returns_garbage/instances", json={"args": args})
    assert created.status_code == 201, created.text
    one = await api.get(f"/api/v1/instances/{created.json()['id']}")
    assert one.status_code == 200 and one.json()["args"] == args
    page = await api.get("/api/v1/instances", params={"job": "returns_garbage"})
    assert page.status_code == 200 and [i["id"] for i in page.json()["items"]] == [
        created.json()["id"]
    ]


async def test_naive_filters_are_utc(api: httpx.AsyncClient) -> None:
    job = "sync_sleeper"
    created = (await api.post(f"/api/v1/jobs/{job}/instances", json={})).json()
    at = created["created_at"][:19]  # naive, to the second
    after = await api.get("/api/v1/instances", params={"job": job, "created_after": "2000-01-01"})
    before = await api.get("/api/v1/instances", params={"job": job, "created_before": at})
    assert [i["id"] for i in after.json()["items"]] == [created["id"]]
    assert before.json()["items"] == []  # created after that second began


async def test_a_client_cannot_take_the_bulk_retry_key_of_an_instance(
    api: httpx.AsyncClient,
) -> None:
    job = "always_fails"
    created = (await api.post(f"/api/v1/jobs/{job}/instances", json={})).json()
    await api.post(f"/api/v1/instances/{created['id']}/cancel")
    squat = await api.post(
        f"/api/v1/jobs/{job}/instances",
        json={},
        headers={"Idempotency-Key": f"retry-of:{created['id']}"},
    )
    assert squat.status_code == 422
    retried = await api.post("/api/v1/instances/retry", json={"job": job, "states": ["cancelled"]})
    assert retried.status_code == 200 and retried.json()["retried"] == 1


async def test_enqueue_and_the_client_refuse_what_the_api_refuses(
    live: LiveApi, api: httpx.AsyncClient
) -> None:
    async with live.store.engine.connect() as conn:
        for bad, kwargs in (
            ("args", {"args": nested(MAX_JSON_DEPTH + 1)}),
            ("args.x", {"args": {"x": float("nan")}}),
            ("idempotency_key", {"idempotency_key": RESERVED}),
            ("idempotency_key", {"idempotency_key": ""}),
        ):
            with pytest.raises(InvalidOptionsError) as refused:
                await enqueue_async(conn, FREE, **kwargs)
            assert refused.value.field == bad
    async with AsyncClient("http://api", http=api) as client:
        with pytest.raises(InvalidOptionsError) as refused:
            await client.trigger(FREE, nested(MAX_JSON_DEPTH + 1))
        assert refused.value.field == "args"
        with pytest.raises(InvalidOptionsError) as refused:
            await client.trigger_batch([{"job_key": FREE, "args": {"a": "\x00"}}])
        assert refused.value.field == "items.0.args.a"


async def test_argument_size_is_bounded() -> None:
    check_json({"a": "x" * 1000}, max_bytes=2000)
    with pytest.raises(InvalidOptionsError, match="bytes encoded"):
        check_json({"a": "x" * 3000}, max_bytes=2000)
    with pytest.raises(InvalidOptionsError) as refused:
        check_json({"a": [1, {"b": object()}]})
    assert refused.value.field == "args.a.1.b"
    assert json.dumps(nested(MAX_JSON_DEPTH))  # the limit itself is plain JSON


async def test_a_result_that_could_not_be_read_back_fails_the_attempt() -> None:
    from jobplane_worker.isolation_child import _ok_message

    assert _ok_message({"ok": nested(10)}) == {"kind": "ok", "result": {"ok": nested(10)}}
    for bad in (nested(MAX_JSON_DEPTH + 1), {"x": float("inf")}, "a\x00b"):
        message = _ok_message(bad)
        assert message["kind"] == "error" and "not JSON serialisable" in str(message), bad


async def test_checkpoints_and_progress_that_could_not_be_stored_are_refused_in_the_job() -> None:
    from jobplane.context import JobContext, bind_worker, pending_progress

    saved: list[Any] = []

    async def saver(data: Any) -> bool:
        saved.append(data)
        return True

    ctx = bind_worker(
        JobContext(instance_id=uuid4(), job_key="j", attempt=1, scheduled_at=None, worker_id="w"),
        saver=saver,
    )
    await ctx.checkpoint({"done": nested(5)})
    for bad in (nested(MAX_JSON_DEPTH + 1), {"x": float("nan")}, {"x": "\x00"}):
        with pytest.raises(InvalidOptionsError) as refused:
            await ctx.checkpoint(bad)
        assert refused.value.field.startswith("checkpoint")
    assert saved == [{"done": nested(5)}]  # nothing unreadable reached the saver
    ctx.progress(0.5, "half way")
    for message in ("a\x00b", "m" * 1001):
        with pytest.raises(InvalidOptionsError):
            ctx.progress(0.6, message)
    assert pending_progress(ctx) == (0.5, "half way")


async def test_values_stored_before_the_limits_never_break_reads(
    live: LiveApi, api: httpx.AsyncClient
) -> None:
    from jobplane.domain.models import NewInstance

    # As an older version stored them: straight into the store, past every entrance's check.
    [poisoned] = await live.store.create_instances(
        [NewInstance(job_key="too_slow", args={"deep": nested(300)})]
    )
    one = await api.get(f"/api/v1/instances/{poisoned.id}")
    assert one.status_code == 200, one.text
    assert one.json()["args"] is None and one.json()["omitted"] == ["args"]
    page = await api.get("/api/v1/instances", params={"job": "too_slow"})
    assert page.status_code == 200 and page.json()["items"][0]["omitted"] == ["args"]
