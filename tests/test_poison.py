"""Poison items on real Postgres and Redis: data the database refuses (or the store cannot even
encode) for one item is logged with the item, that item is parked, and the role keeps
processing the others; a bus entry that does not decode is dead-lettered, and the worker keeps
consuming."""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta

import pytest
from pydantic import BaseModel
from sqlalchemy import text

from jobplane import App, JobContext
from jobplane.bus.abc import Bus
from jobplane.bus.keys import band_of
from jobplane.bus.redis import RedisBus
from jobplane.dispatch import Dispatcher
from jobplane.domain.limits import MAX_INT_DIGITS
from jobplane.domain.states import InstanceState as S
from jobplane.errors import InvalidOptionsError
from jobplane.store.sql import SqlStore
from tests.scheduler_helpers import running_scheduler
from tests.store_helpers import define
from tests.test_bus_malformed import MALFORMED, left_pending
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


#: More digits than ``json.dumps`` writes out (4,300 by default): the store's encoder raises
#: ValueError for it, which is neither a refusal nor an outage.
HUGE = 10**5000


class Until(BaseModel):
    at: float  # a time.time(): the jobs given the same one end together, in one batch


async def _until(args: Until) -> None:
    await asyncio.sleep(max(0.0, args.at - time.time()))


@app.triggered(max_concurrency=10)
async def fine_until(args: Until) -> int:
    await _until(args)
    return 1


@app.triggered(max_concurrency=10)
async def huge_until(args: Until) -> int:
    await _until(args)
    return HUGE


@app.triggered(max_concurrency=10)
async def huge_result() -> int:
    return HUGE


@app.triggered(max_concurrency=10)
async def huge_in_result() -> dict[str, list[int]]:
    return {"values": [1, -HUGE]}


@app.triggered(max_concurrency=10)
async def huge_checkpoint(ctx: JobContext) -> str:
    try:
        await ctx.checkpoint(HUGE)
    except InvalidOptionsError as exc:
        return exc.field
    return "saved"


async def test_a_refused_outcome_is_parked_and_the_worker_keeps_recording(
    pg_store: SqlStore, redis_bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="jobplane_worker.worker")
    await _refuse(pg_store, "refuse_outcome", "UPDATE", "NEW.result::text LIKE '%refuse-me%'")
    dispatcher = Dispatcher(pg_store, redis_bus)
    async with running_worker(app, pg_store, redis_bus, concurrency=8, batch_size=20) as worker:
        first = [await dispatcher.trigger("fine", {"value": i}) for i in range(5)]
        unserialisable = await dispatcher.trigger("nul_result")
        poison = [await dispatcher.trigger("refused_result") for _ in range(2)]
        nul = await dispatcher.trigger("nul_error")
        more = [await dispatcher.trigger("fine", {"value": i}) for i in range(5, 10)]
        done = await settled(
            pg_store, [i.id for i in [*first, unserialisable, *poison, nul, *more]]
        )
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
    # An error message with a NUL is kept, the NUL made visible (jsonb cannot store it).
    kept = by_id[nul.id]
    assert kept.state is S.TERMINATED and kept.error is not None
    assert (kept.error.type, kept.error.message) == ("ValueError", "bad\\x00byte")


async def test_a_result_with_an_integer_too_long_to_store_fails_its_attempt_clearly(
    pg_store: SqlStore, redis_bus: Bus
) -> None:
    dispatcher = Dispatcher(pg_store, redis_bus)
    async with running_worker(app, pg_store, redis_bus, concurrency=8) as worker:
        bare = await dispatcher.trigger("huge_result")
        nested = await dispatcher.trigger("huge_in_result")
        checkpointed = await dispatcher.trigger("huge_checkpoint")
        done = await settled(pg_store, [bare.id, nested.id, checkpointed.id])
        # Still alive and recording.
        [after] = await settled(pg_store, [(await dispatcher.trigger("fine", {"value": 7})).id])
        assert not worker.running
    assert after.state is S.SUCCEEDED and after.result == 7
    for failed, at in zip(done[:2], ["result", "result.values.1"], strict=True):
        assert failed.state is S.TERMINATED and failed.error is not None
        assert failed.error.type == "TypeError"
        assert failed.error.message == (
            f"job result is not JSON serialisable: {at}: integers may have at most "
            f"{MAX_INT_DIGITS} digits"
        )
    # A checkpoint is refused by the same check, naming its field, before the store sees it.
    assert done[2].state is S.SUCCEEDED and done[2].result == "checkpoint"


async def test_an_outcome_the_store_cannot_encode_is_parked_and_the_batch_is_recorded(
    pg_store: SqlStore,
    redis_bus: Bus,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Should an outcome ever pass the worker's checks that the store's encoder cannot write
    (here: with the result check switched off, an integer of 5,001 digits, for which
    ``json.dumps`` raises ValueError), it is isolated like a refused one: the rest of its batch
    is recorded, it is parked as a failure with a log line, and the worker goes on."""
    monkeypatch.setattr("jobplane_worker.attempt.check_json", lambda *args, **kwargs: None)
    caplog.set_level(logging.ERROR, logger="jobplane_worker.worker")
    dispatcher = Dispatcher(pg_store, redis_bus)
    async with running_worker(app, pg_store, redis_bus, concurrency=8, batch_size=20) as worker:
        until = {"at": time.time() + 1.0}
        fine = [await dispatcher.trigger("fine_until", until) for _ in range(4)]
        poison = await dispatcher.trigger("huge_until", until)
        done = await settled(pg_store, [i.id for i in [*fine, poison]])
        [after] = await settled(pg_store, [(await dispatcher.trigger("fine", {"value": 3})).id])
        assert not worker.running
    assert after.state is S.SUCCEEDED and after.result == 3
    by_id = {i.id: i for i in done}
    assert {by_id[i.id].state for i in fine} == {S.SUCCEEDED}
    parked = by_id[poison.id]
    assert parked.state is S.TERMINATED and parked.result is None
    assert parked.error is not None and parked.error.type == "OutcomeNotStored"
    assert "4300 digits" in parked.error.message
    lines = [r for r in caplog.records if getattr(r, "action", "") == "worker.outcome_error"]
    assert [getattr(r, "instance_id", None) for r in lines] == [str(poison.id)]
    assert lines[0].exc_info is not None  # not the database's answer: where it failed


async def test_malformed_bus_entries_are_dead_lettered_and_the_worker_keeps_consuming(
    pg_store: SqlStore, redis_bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="jobplane.bus")
    assert isinstance(redis_bus, RedisBus)
    stream = redis_bus.keys.queue_stream("default", band_of(5))
    await redis_bus.consumer("gone", ["default"]).read(1, 10)  # the groups
    # Some were read by a worker that died holding them: this one reclaims them.
    held = list(MALFORMED.values())[:4]
    for raw in held:
        await left_pending(redis_bus, stream, raw)
    dispatcher = Dispatcher(pg_store, redis_bus)
    async with running_worker(app, pg_store, redis_bus) as worker:
        for raw in MALFORMED.values():
            await redis_bus.client.xadd(stream, {"d": raw})
        [after] = await settled(pg_store, [(await dispatcher.trigger("fine", {"value": 5})).id])

        async def all_dead_lettered() -> bool:
            dead = await redis_bus.dead_letters("default", 100)
            return len(dead) == len(MALFORMED) + len(held)

        await wait_for(all_dead_lettered, what="every malformed entry dead-lettered")
        [later] = await settled(pg_store, [(await dispatcher.trigger("fine", {"value": 6})).id])
        assert not worker.running
    assert (after.state, after.result, later.state) == (S.SUCCEEDED, 5, S.SUCCEEDED)
    lines = [r for r in caplog.records if getattr(r, "action", "") == "bus.dead_letter"]
    assert len(lines) == len(MALFORMED) + len(held)


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
