"""A cron expression that can never fire is refused where it enters, and one stored before that
(old data) stops neither the API nor the leader: it is shown on its job, and every other job
keeps firing."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from sqlalchemy import update

from jobplane.bus.abc import Bus
from jobplane.definitions import announce
from jobplane.domain.options import JobOptions
from jobplane.errors import InvalidOptionsError
from jobplane.store.sql import SqlStore
from jobplane.store.tables import job_definition_versions, job_definitions
from jobplane_api.main import create_app
from jobplane_api.settings import ApiSettings
from tests.api_helpers import problem_of
from tests.scheduler_helpers import DrivenClock, advance_until, applied, running_scheduler
from tests.store_helpers import define

NEVER = ["0 0 30 2 *", "0 0 31 4 *", "0 0 */20 * 1#5", "0 12 30 2 * 15"]


async def _poison(store: SqlStore, key: str, cron: str) -> None:
    """Store ``cron`` on a job as data saved before such expressions were refused would be."""
    definition = await store.get_definition(key)
    options = {**definition.options.model_dump(mode="json"), "cron": cron}
    async with store.engine.begin() as conn:
        await conn.execute(
            update(job_definitions).where(job_definitions.c.key == key).values(options=options)
        )
        await conn.execute(
            update(job_definition_versions)
            .where(job_definition_versions.c.job_key == key)
            .values(options=options)
        )


@pytest.fixture
async def api(store: SqlStore, memory_bus: Bus) -> AsyncIterator[httpx.AsyncClient]:
    """The API on every store; on the in-memory bus, which plays no part in validation."""
    await define(store, "nightly", cron="0 3 * * *", timezone="Europe/Berlin")
    await define(store, "hourly", cron="0 * * * *")
    app = create_app(ApiSettings(auth_enabled=False), store=store, bus=memory_bus)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            yield client


@pytest.mark.parametrize("cron", NEVER)
def test_registration_refuses_a_cron_that_never_fires(cron: str) -> None:
    with pytest.raises(InvalidOptionsError) as raised:
        JobOptions.parse(key="j", kind="recurring", cron=cron)
    assert raised.value.field == "cron" and "never fires" in raised.value.reason


@pytest.mark.parametrize("cron", NEVER)
async def test_an_edit_to_a_cron_that_never_fires_is_422_naming_cron(
    api: httpx.AsyncClient, cron: str
) -> None:
    response = await api.patch(
        "/api/v1/jobs/nightly", json={"version": 1, "options": {"cron": cron}}
    )
    assert response.status_code == 422, response.text
    assert [e["field"] for e in response.json()["errors"]] == ["cron"]
    job = (await api.get("/api/v1/jobs/nightly")).json()
    assert job["version"] == 1 and job["options"]["cron"] == "0 3 * * *"


#: Expressions that fire in UTC but never in the zone: every match falls in a spring gap.
NEVER_IN_ZONE = [("*/15 2 * 3 0#2", "America/New_York"), ("* 2 * 3 0L", "Europe/Berlin")]


@pytest.mark.parametrize(("cron", "zone"), NEVER_IN_ZONE)
def test_registration_refuses_a_cron_that_never_fires_in_its_zone(cron: str, zone: str) -> None:
    """The per-field check reads the expression without the zone: these were accepted, and
    the leader then logged the job's schedule error and never fired it."""
    assert JobOptions.parse(key="j", kind="recurring", cron=cron).cron == cron  # (UTC: fires)
    with pytest.raises(InvalidOptionsError) as raised:
        JobOptions.parse(key="j", kind="recurring", cron=cron, timezone=zone)
    assert raised.value.field == "cron"
    assert "never fires" in raised.value.reason and zone in raised.value.reason
    # Options read back from the store are not re-checked (see STORED).
    values = {"key": "j", "kind": "recurring", "cron": cron, "timezone": zone}
    assert JobOptions.from_stored(values).timezone == zone


async def test_an_edit_that_makes_a_cron_never_fire_in_its_zone_is_422_naming_cron(
    api: httpx.AsyncClient, store: SqlStore
) -> None:
    """Either half of the edit: the expression (in the job's zone), or the zone alone."""
    await define(store, "spring", cron="*/15 2 * 3 0#2")  # (UTC: it fires)
    edits = [
        ("nightly", {"cron": "* 2 * 3 0L"}, "Europe/Berlin"),
        ("spring", {"timezone": "America/New_York"}, "America/New_York"),
    ]
    for key, options, zone in edits:
        response = await api.patch(f"/api/v1/jobs/{key}", json={"version": 1, "options": options})
        body = problem_of(response, 422)
        assert [e["field"] for e in body["errors"]] == ["cron"]
        assert "never fires" in body["errors"][0]["reason"] and zone in body["errors"][0]["reason"]
        assert (await api.get(f"/api/v1/jobs/{key}")).json()["version"] == 1


async def test_stored_never_firing_cron_is_shown_on_its_job_and_rollback_to_it_is_422(
    api: httpx.AsyncClient, store: SqlStore
) -> None:
    await _poison(store, "nightly", "0 0 30 2 *")
    listed = await api.get("/api/v1/jobs")
    assert listed.status_code == 200, listed.text
    by_key = {j["key"]: j for j in listed.json()}
    assert "never fires" in by_key["nightly"]["schedule_error"]
    assert by_key["nightly"]["next_fire"] is None
    assert by_key["hourly"]["schedule_error"] is None and by_key["hourly"]["next_fire"]
    one = await api.get("/api/v1/jobs/nightly")
    assert one.status_code == 200 and one.json()["next_fire_times"] == []
    assert "never fires" in one.json()["schedule_error"]
    # An edit mends it; rolling back to the stored version is refused like the edit would be.
    fixed = await api.patch(
        "/api/v1/jobs/nightly", json={"version": 1, "options": {"cron": "0 4 * * *"}}
    )
    assert fixed.status_code == 200 and fixed.json()["schedule_error"] is None
    back = await api.post("/api/v1/jobs/nightly/rollback", json={"to_version": 1, "version": 2})
    assert back.status_code == 422, back.text
    assert [e["field"] for e in back.json()["errors"]] == ["cron"]


async def test_a_stored_never_firing_cron_does_not_stop_the_leader(
    store: SqlStore, bus: Bus
) -> None:
    await define(store, "broken", cron="* * * * * *")
    await define(store, "tick", cron="* * * * * *")
    await _poison(store, "broken", "0 0 30 2 *")
    clock = DrivenClock(store)
    async with running_scheduler(store, bus, clock=clock) as scheduler:

        async def ticks(key: str) -> int:
            return sum((await store.count_by_state(key)).values())

        await advance_until(clock, lambda: ticks("tick"), 3, what="ticks of the sound job")
        assert scheduler.lease is not None  # still leading
        # An edit of the broken job (announced like the API does) plans it again.
        saved = await store.save_definition(
            (await store.get_definition("broken")).options.edited(cron="* * * * * *"),
            expected_version=1,
            actor="test",
        )
        assert saved is not None
        await announce(bus, [saved])  # the event, over the bus, re-plans it
        await applied(scheduler, "broken", saved.version)
        await advance_until(clock, lambda: ticks("broken"), 1, what="the mended job's first tick")
    assert sum((await store.count_by_state("tick")).values()) >= 3
