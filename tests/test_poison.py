"""Poison items on real Postgres: data the database refuses for one item is logged with the
item, that item is parked, and the role keeps processing the others."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
from pydantic import BaseModel
from sqlalchemy import text

from jobplane import App
from jobplane.bus.abc import Bus
from jobplane.dispatch import Dispatcher
from jobplane.domain.states import InstanceState as S
from jobplane.store.sql import SqlStore
from tests.scheduler_helpers import running_scheduler
from tests.store_helpers import define
from tests.worker_helpers import running_worker, settled, wait_for

pytestmark = pytest.mark.timeout(120)

app = App("poison")


class Value(BaseModel):
    value: int


@app.triggered(max_concurrency=10)
async def fine(args: Value) -> int:
    return args.value


@app.triggered(max_concurrency=10)
async def nul_result() -> dict[str, str]:
    # A NUL character cannot be stored in jsonb: the worker refuses it before the database.
    return {"text": "before\x00after"}


@app.triggered(max_concurrency=10)
async def refused_result() -> dict[str, str]:
    return {"text": "refuse-me"}  # refused by a trigger the test installs


@app.triggered(max_concurrency=10)
async def nul_error() -> None:
    raise ValueError("bad\x00byte")


async def test_a_refused_outcome_is_parked_and_the_worker_keeps_recording(
    pg_store: SqlStore, redis_bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="jobplane_worker.worker")
    await _refuse(pg_store, "refuse_outcome", "UPDATE", "NEW.result::text LIKE '%refuse-me%'")
    dispatcher = Dispatcher(pg_store, redis_bus)
    async with running_worker(app, pg_store, redis_bus, concurrency=8, batch_size=20) as worker:
        first = [await dispatcher.trigger("fine", {"value": i}) for i in range(5)]
        unserialisable = await dispatcher.trigger("nul_result")
        poison = [await dispatcher.trigger("refused_result"), await dispatcher.trigger("nul_error")]
        more = [await dispatcher.trigger("fine", {"value": i}) for i in range(5, 10)]
        done = await settled(pg_store, [i.id for i in [*first, unserialisable, *poison, *more]])
        # Still alive and recording after the poison.
        [after] = await settled(pg_store, [(await dispatcher.trigger("fine", {"value": 99})).id])
        assert not worker.running
    by_id = {i.id: i for i in done}
    assert {by_id[i.id].state for i in first + more} == {S.SUCCEEDED}
    assert after.state is S.SUCCEEDED and after.result == 99
    for instance in poison:
        parked = by_id[instance.id]
        assert parked.state is S.TERMINATED  # Failed, no retries left
        assert parked.error is not None and parked.error.type == "OutcomeNotStored"
        assert parked.result is None
    refused = [r for r in caplog.records if getattr(r, "action", "") == "worker.outcome_refused"]
    assert {getattr(r, "instance_id", None) for r in refused} == {str(i.id) for i in poison}
    # A result that could never be stored fails its attempt in the worker, before the database.
    failed = by_id[unserialisable.id]
    assert failed.state is S.TERMINATED and failed.error is not None
    assert failed.error.type == "TypeError" and "NUL" in failed.error.message


async def _refuse(store: SqlStore, name: str, when: str, condition: str) -> None:
    """A trigger in the database that refuses rows matching ``condition`` (check violation)."""
    async with store.engine.begin() as conn:
        await conn.execute(
            text(
                f"CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                f"IF {condition} THEN RAISE EXCEPTION '{name}: refused' "
                "USING ERRCODE = 'check_violation'; END IF; RETURN NEW; END $$"
            )
        )
        await conn.execute(
            text(
                f"CREATE TRIGGER {name} BEFORE {when} ON job_instances "
                f"FOR EACH ROW EXECUTE FUNCTION {name}()"
            )
        )


async def test_a_refused_job_or_sweep_step_does_not_stop_the_leader(
    pg_store: SqlStore, redis_bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)
    await define(pg_store, "healthy", cron="* * * * * *")
    await define(pg_store, "poisoned", cron="* * * * * *")
    await define(pg_store, "delayed")
    await _refuse(pg_store, "refuse_tick", "INSERT", "NEW.job_key = 'poisoned'")
    await _refuse(
        pg_store, "refuse_promote", "UPDATE", "NEW.job_key = 'delayed' AND NEW.state = 'enqueued'"
    )
    await define(pg_store, "also_delayed")
    async with running_scheduler(pg_store, redis_bus) as scheduler:
        dispatcher = Dispatcher(pg_store, redis_bus)
        # Due in a second, not less: a shorter delay may already have passed when the insert
        # runs on a loaded machine, and the instance would be created Enqueued, never promoted.
        stuck = await dispatcher.trigger("delayed", delay=timedelta(seconds=1))
        fine = await dispatcher.trigger("also_delayed", delay=timedelta(seconds=1.1))

        async def healthy_fired(n: int) -> bool:
            return sum((await pg_store.count_by_state("healthy")).values()) >= n

        await wait_for(lambda: healthy_fired(4), timeout_s=15, what="four healthy ticks")
        assert scheduler.lease is not None
        assert scheduler._duties is not None and not scheduler._duties.done()
    assert await pg_store.count_by_state("poisoned") == {}
    assert (await pg_store.get_instance(stuck.id)).state is S.SCHEDULED
    assert (await pg_store.get_instance(fine.id)).state is S.ENQUEUED
    refused = {
        getattr(r, "instance_id", None)
        for r in caplog.records
        if getattr(r, "action", "") == "store.promotion_refused"
    }
    assert refused == {str(stuck.id)}
    actions = {getattr(r, "action", "") for r in caplog.records}
    assert "scheduler.fire_refused" in actions
    assert all(
        getattr(r, "job_key", "poisoned") == "poisoned"
        for r in caplog.records
        if getattr(r, "action", "") == "scheduler.fire_refused"
    )
