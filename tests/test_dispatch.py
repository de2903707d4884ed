"""Single triggers through the Dispatcher: validated against the definition it remembers, but
never created against one that moved on; published, or left for the sweep when the bus is
out of reach."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from datetime import timedelta
from uuid import UUID

import pytest

from jobplane import triggering
from jobplane.bus.abc import Bus
from jobplane.bus.envelope import Envelope
from jobplane.bus.factory import open_bus
from jobplane.dispatch import Dispatcher, InvalidArgumentsError, JobDisabledError
from jobplane.domain.models import Instance, InstanceFilter, InstanceSource, NewInstance
from jobplane.domain.options import JobOptions
from jobplane.domain.states import InstanceState as S
from jobplane.errors import (
    BusUnavailableError,
    IdempotencyConflictError,
    InvalidOptionsError,
    JobNotFoundError,
)
from jobplane.ids import new_id as uuid7
from jobplane.store.sql import SqlStore
from jobplane.triggering import envelope_for
from tests.store_helpers import define


async def _edit(store: SqlStore, key: str, **changes: object) -> None:
    """An edit saved in the store only: no mark, no event reaches the dispatcher."""
    current = await store.get_definition(key)
    saved = await store.save_definition(
        current.options.edited(**changes), expected_version=current.version, actor="test"
    )
    assert saved is not None


async def _count(store: SqlStore) -> int:
    return len((await store.list_instances(InstanceFilter(), limit=1000)).items)


async def test_a_job_disabled_since_it_was_remembered_takes_no_trigger(
    store: SqlStore, bus: Bus
) -> None:
    await define(store, "job")
    dispatcher = Dispatcher(store, bus)
    first = await dispatcher.trigger("job")  # the definition is remembered from here
    assert first.state is S.ENQUEUED and first.published_at is not None
    await _edit(store, "job", disabled=True)
    with pytest.raises(JobDisabledError):
        await dispatcher.trigger("job")
    assert await _count(store) == 1
    await _edit(store, "job", disabled=False)
    assert (await dispatcher.trigger("job")).state is S.ENQUEUED


async def test_a_replay_after_the_job_was_disabled_returns_the_first_instance(
    store: SqlStore, bus: Bus
) -> None:
    """The client's answer was lost, an operator disabled the job meanwhile, the client sends
    the same request again: the first instance exists, and the replay says so (it answered
    "job disabled", which reads as "not created"). A new request is still refused."""
    await define(store, "job")
    dispatcher = Dispatcher(store, bus)
    first = await dispatcher.trigger("job", {"n": 1}, idempotency_key="order-7")
    await _edit(store, "job", disabled=True)
    again = await Dispatcher(store, bus).trigger("job", {"n": 1}, idempotency_key="order-7")
    assert again.id == first.id
    with pytest.raises(IdempotencyConflictError):
        await dispatcher.trigger("job", {"n": 2}, idempotency_key="order-7")
    with pytest.raises(JobDisabledError):
        await dispatcher.trigger("job", {"n": 1}, idempotency_key="order-8")
    with pytest.raises(JobDisabledError):
        await dispatcher.trigger("job", {"n": 1})
    assert await _count(store) == 1


async def test_a_batch_replayed_after_the_job_was_disabled_returns_its_first_instances(
    store: SqlStore, bus: Bus
) -> None:
    """As a single trigger: the batch's replayed requests stand, a new one is refused (and
    then nothing of the batch is created)."""
    await define(store, "job")
    await define(store, "other")
    dispatcher = Dispatcher(store, bus)
    first = await dispatcher.trigger_many(
        [
            triggering.trigger_request("job", {"n": 1}, idempotency_key="a"),
            triggering.trigger_request("other", {"n": 2}, idempotency_key="b"),
        ]
    )
    await _edit(store, "job", disabled=True)
    again = await Dispatcher(store, bus).trigger_many(
        [
            triggering.trigger_request("job", {"n": 1}, idempotency_key="a"),
            triggering.trigger_request("other", {"n": 2}, idempotency_key="b"),
        ]
    )
    assert [i.id for i in again] == [i.id for i in first]
    with pytest.raises(JobDisabledError):
        await dispatcher.trigger_many(
            [
                triggering.trigger_request("other", {"n": 3}),
                triggering.trigger_request("job", {"n": 1}, idempotency_key="c"),
            ]
        )
    assert await _count(store) == 2


async def test_a_trigger_from_code_takes_no_reserved_idempotency_key(
    store: SqlStore, bus: Bus
) -> None:
    """As over REST: a ``retry-of:`` key is a bulk retry's; a trigger that took it would make
    that retry refuse (the key is taken by another request)."""
    await define(store, "job")
    made = await Dispatcher(store, bus).trigger("job")
    with pytest.raises(InvalidOptionsError) as refused:
        await Dispatcher(store, bus).trigger("job", idempotency_key=f"retry-of:{made.id}")
    assert refused.value.field == "idempotency_key" and "reserved" in refused.value.reason
    with pytest.raises(InvalidOptionsError):
        await Dispatcher(store, bus).trigger("job", idempotency_key="a\x00b")
    assert await _count(store) == 1


@pytest.mark.parametrize("priority", [10, 99, -1, True, 2.5, "3"])
async def test_a_trigger_from_code_takes_only_a_priority_of_the_range(
    store: SqlStore, bus: Bus, priority: object
) -> None:
    """Over REST a priority out of 0-9 is a 422; from code it was stored, and every leader
    that published the instance stopped on it (its stream band is undefined)."""
    await define(store, "job")
    dispatcher = Dispatcher(store, bus)
    with pytest.raises(InvalidOptionsError) as refused:
        await dispatcher.trigger("job", priority=priority)  # type: ignore[arg-type]
    assert refused.value.field == "priority"
    with pytest.raises(InvalidOptionsError):
        await dispatcher.trigger_many(
            [NewInstance(job_key="job"), NewInstance(job_key="job", priority=priority)]  # type: ignore[arg-type]
        )
    assert await _count(store) == 0
    assert (await dispatcher.trigger("job", priority=9)).priority == 9


@pytest.mark.parametrize(
    "delay", [timedelta(days=999_999_999), timedelta(days=3651), -timedelta(1)]
)
async def test_a_delay_from_code_is_bounded(store: SqlStore, bus: Bus, delay: timedelta) -> None:
    """A billion days raised OverflowError from the clock's arithmetic; over REST ten years
    is the bound."""
    await define(store, "job")
    with pytest.raises(InvalidOptionsError) as refused:
        await Dispatcher(store, bus).trigger("job", delay=delay)
    assert refused.value.field == "delay"
    assert await _count(store) == 0


async def test_a_stored_priority_out_of_range_is_published_in_the_nearest_band(
    store: SqlStore, bus: Bus
) -> None:
    """A row stored before every way in checked its priority: publishing it raised, and the
    leader's publish stopped on it, every term, with every instance published beside it."""
    await define(store, "job")
    dispatcher = Dispatcher(store, bus)
    made = await dispatcher.trigger("job", priority=9)
    old = [
        dataclasses.replace(made, priority=99),
        dataclasses.replace(made, id=uuid7(), priority=-3),
    ]
    await dispatcher.publish(old, force=True)
    consumer = bus.consumer("w1", ["default"])
    got = await consumer.read(10, 50)
    assert {d.envelope.instance_id for d in got} >= {made.id}
    assert len(got) == 3  # the trigger's own message, then both republished


async def test_arguments_are_checked_against_the_stored_schema(store: SqlStore, bus: Bus) -> None:
    """A worker registers a new argument schema (same version) after the dispatcher read
    the old one: the next trigger is validated against the new schema."""
    options = JobOptions.parse(key="job", kind="triggered")
    await store.register_definition(options, {"type": "object"}, "w1")
    dispatcher = Dispatcher(store, bus)
    await dispatcher.trigger("job", {"n": "one"})
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    await store.register_definition(options, schema, "w2")
    with pytest.raises(InvalidArgumentsError) as info:
        await dispatcher.trigger("job", {"n": "one"})
    assert info.value.field == "args.n"
    await dispatcher.trigger("job", {"n": 1})
    assert await _count(store) == 2


async def test_unknown_job(store: SqlStore, bus: Bus) -> None:
    with pytest.raises(JobNotFoundError):
        await Dispatcher(store, bus).trigger("nope")


async def test_held_and_delayed_triggers_are_not_published(store: SqlStore, bus: Bus) -> None:
    await define(store, "job")
    held = await Dispatcher(store, bus, hold_triggered=True).trigger("job")
    assert held.state is S.SCHEDULED and held.run_at is None and held.published_at is None


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
async def test_a_trigger_the_bus_did_not_take_is_left_for_the_sweep(store: SqlStore) -> None:
    """Redis is out of reach: the trigger still succeeds (it is committed), and its
    publication record is cleared so the sweep publishes it after its short grace."""
    await define(store, "job")
    unreachable = open_bus("redis://127.0.0.1:1/0", "nowhere")
    try:
        async with Dispatcher(store, unreachable) as dispatcher:
            made = await dispatcher.trigger("job")
    finally:
        await unreachable.close()
    stored = await store.get_instance(made.id)
    assert stored.state is S.ENQUEUED and stored.published_at is None


async def test_a_trigger_whose_send_failed_answers_unpublished_as_stored(
    store: SqlStore, bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside ``async with`` the answer waits for the send: one that failed, its mark
    cleared, is answered without ``published_at``, as the store has it (it was answered
    with the mark its insert wrote, as if sent)."""
    await define(store, "job")

    async def away(envelopes: Sequence[tuple[str, Envelope]]) -> None:
        raise BusUnavailableError("redis is away")

    monkeypatch.setattr(bus, "publish", away)
    made = await Dispatcher(store, bus).trigger("job")
    stored = await store.get_instance(made.id)
    assert stored.state is S.ENQUEUED and stored.published_at is None
    assert made.published_at is None


async def test_a_single_trigger_returns_at_its_commit_and_later_ones_share_the_next_send(
    store: SqlStore, bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trigger is acknowledged by its commit (marked published in the same statement); its
    message follows from a task of the dispatcher's, so the caller never waits on the bus, and
    the triggers committed while a send is under way go out together in the next one."""
    await define(store, "job")
    batches: list[list[UUID]] = []
    let_go = asyncio.Event()
    send = bus.publish

    async def held_send(envelopes: Sequence[tuple[str, Envelope]]) -> None:
        batches.append([e.instance_id for _, e in envelopes])
        await let_go.wait()
        await send(envelopes)

    monkeypatch.setattr(bus, "publish", held_send)
    async with Dispatcher(store, bus) as dispatcher:
        first = await dispatcher.trigger("job")
        await asyncio.sleep(0)  # the send task starts, and waits on the bus
        async with asyncio.timeout(10):  # none waits on the send
            more = [await dispatcher.trigger("job") for _ in range(3)]
        assert batches == [[first.id]]
        for made in (first, *more):
            stored = await store.get_instance(made.id)
            assert stored.state is S.ENQUEUED and stored.published_at is not None
        let_go.set()
        await dispatcher.flush()
        assert batches == [[first.id], [m.id for m in more]]
    delivered = await bus.consumer("w1", ["default"]).read(10, 500)
    assert [d.envelope.instance_id for d in delivered] == [first.id, *(m.id for m in more)]


async def test_outside_async_with_a_trigger_returns_once_its_message_is_sent(
    store: SqlStore, bus: Bus
) -> None:
    """Without ``async with`` nobody would wait for a send in the background (a caller that
    closes the bus right after would lose it to the sweep): the trigger sends first."""
    await define(store, "job")
    made = await Dispatcher(store, bus).trigger("job")
    envelope = Envelope(instance_id=made.id, job_key="job", priority=made.priority)
    assert await bus.queued([("default", envelope)]) == {made.id}


async def test_a_send_that_fails_unexpectedly_is_logged_and_left_for_the_sweep(
    store: SqlStore, bus: Bus, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    await define(store, "job")

    async def broken(envelopes: Sequence[tuple[str, Envelope]]) -> None:
        raise RuntimeError("a bug in the bus")

    monkeypatch.setattr(bus, "publish", broken)
    with caplog.at_level(logging.ERROR, logger="jobplane.dispatch"):
        async with Dispatcher(store, bus) as dispatcher:
            made = await dispatcher.trigger("job")
    stored = await store.get_instance(made.id)
    assert stored.state is S.ENQUEUED and stored.published_at is None  # the sweep's to send
    [record] = [r for r in caplog.records if r.action == "dispatch.publish_failed"]  # type: ignore[attr-defined]
    assert record.exc_info is not None and "a bug in the bus" in str(record.exc_info[1])


async def test_a_claim_that_parks_right_after_the_publish_keeps_its_park(
    store: SqlStore, bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race: a worker reads the message and claims before the dispatcher has recorded the
    publication; the job is at its limit, so the claim parks the instance (clears its mark)
    for whoever frees a slot to republish. The publication's mark must not land after the
    park: a parked instance that looks published is republished by nobody until the sweep's
    republish threshold. So the dispatcher marks first, then sends."""
    await define(store, "job", max_concurrency=1, on_limit="wait")
    [running] = await store.create_instances([NewInstance(job_key="job")])
    assert len((await store.claim([running.id], "w1", 30, ["job"])).claimed) == 1
    [waiting] = await store.create_instances([NewInstance(job_key="job")])
    parked: list[UUID] = []
    send = bus.publish

    async def send_then_claim_at_once(envelopes: Sequence[tuple[str, Envelope]]) -> None:
        await send(envelopes)
        parked.extend((await store.claim([waiting.id], "w2", 30, ["job"])).waiting)

    monkeypatch.setattr(bus, "publish", send_then_claim_at_once)
    await Dispatcher(store, bus).publish([waiting])
    assert parked == [waiting.id]
    stored = await store.get_instance(waiting.id)
    assert stored.state is S.ENQUEUED and stored.published_at is None  # still parked
    # The slot frees: the parked instance is found and republished at once.
    [again] = await store.republish_waiting(["job"], 10)
    assert again.id == waiting.id


async def test_publishing_resumes_with_its_mark_once_the_bus_is_back(
    store: SqlStore, bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the bus is out of reach the sweep retries its batches: nothing is marked for
    them (marking and clearing each pass would be writes for nothing); the first send that
    works records its mark, and the next batch is marked before it is sent again."""
    await define(store, "job")
    first, second = await store.create_instances(
        [NewInstance(job_key="job"), NewInstance(job_key="job")]
    )
    dispatcher = Dispatcher(store, bus)
    send = bus.publish

    async def away(envelopes: Sequence[tuple[str, Envelope]]) -> None:
        raise BusUnavailableError("redis is away")

    monkeypatch.setattr(bus, "publish", away)
    for _ in range(2):
        await dispatcher.publish([first])
        assert (await store.get_instance(first.id)).published_at is None
    monkeypatch.setattr(bus, "publish", send)
    await dispatcher.publish([first])
    assert (await store.get_instance(first.id)).published_at is not None
    await dispatcher.publish([second])
    assert (await store.get_instance(second.id)).published_at is not None
    consumer = bus.consumer("w1", ["default"])
    delivered = await consumer.read(10, 500)
    assert {d.envelope.instance_id for d in delivered} == {first.id, second.id}


async def test_a_batch_trigger_records_its_publication_in_its_insert_and_sends_each_once(
    store: SqlStore, bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch's Enqueued instances are marked published by the insert itself, not by a second
    write (on both stores); a delayed one is neither marked nor sent, and each Enqueued one
    goes out once."""
    await define(store, "job")
    marks: list[list[UUID]] = []
    mark = store.mark_published

    async def counted_mark(ids: list[UUID], **kwargs: object) -> None:
        marks.append(list(ids))
        await mark(ids, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(store, "mark_published", counted_mark)
    async with Dispatcher(store, bus) as dispatcher:
        now, later, also_now = await dispatcher.trigger_many(
            [
                NewInstance(job_key="job"),
                NewInstance(job_key="job", run_at=await store.now() + timedelta(hours=1)),
                NewInstance(job_key="job"),
            ]
        )
    assert (now.state, later.state, also_now.state) == (S.ENQUEUED, S.SCHEDULED, S.ENQUEUED)
    assert marks == [] and now.published_at is not None  # in the insert
    for made in (now, also_now):
        assert (await store.get_instance(made.id)).published_at is not None
    assert (await store.get_instance(later.id)).published_at is None
    delivered = await bus.consumer("w1", ["default"]).read(10, 500)
    assert sorted(d.envelope.instance_id for d in delivered) == sorted([now.id, also_now.id])


async def test_a_batch_the_bus_cannot_take_is_left_unmarked_for_the_sweep(
    store: SqlStore, bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The send fails: the batch is committed, its marks cleared (the sweep publishes it
    after its short grace), and while the bus stays away the next batch is not marked by
    its insert either (its mark follows a send that works)."""
    await define(store, "job")

    async def away(envelopes: Sequence[tuple[str, Envelope]]) -> None:
        raise BusUnavailableError("redis is away")

    monkeypatch.setattr(bus, "publish", away)
    dispatcher = Dispatcher(store, bus)
    first = await dispatcher.trigger_many([NewInstance(job_key="job") for _ in range(2)])
    # (On Postgres marked by the insert, then cleared:) the answer says what is stored.
    assert [i.published_at for i in first] == [None, None]
    assert not dispatcher.marks_first
    second = await dispatcher.trigger_many([NewInstance(job_key="job") for _ in range(2)])
    # Not marked by the insert while the bus is away:
    assert [i.published_at for i in second] == [None, None]
    for made in (*first, *second):
        stored = await store.get_instance(made.id)
        assert stored.state is S.ENQUEUED and stored.published_at is None


async def test_a_run_now_answers_its_publication_and_sends_once(store: SqlStore, bus: Bus) -> None:
    """Run now records the publication in its move, as a trigger's insert does: the answer
    says it (it said nothing before, published as it was), and the message goes out once."""
    await define(store, "job")
    dispatcher = Dispatcher(store, bus, hold_triggered=True)
    held = await dispatcher.trigger("job")
    ran = await dispatcher.run_now(held.id, "ops")
    assert ran.state is S.ENQUEUED and ran.published_at is not None
    assert (await store.get_instance(held.id)).published_at == ran.published_at
    delivered = await bus.consumer("w1", ["default"]).read(10, 500)
    assert [d.envelope.instance_id for d in delivered] == [held.id]


async def test_a_run_now_inside_async_with_answers_at_its_commit_and_sends_behind(
    store: SqlStore, bus: Bus
) -> None:
    """Inside ``async with`` (as the API uses it) the message goes out behind the answer, as
    a single trigger's does: a caller cancelled after the answer cannot stop the send."""
    await define(store, "job")
    async with Dispatcher(store, bus, hold_triggered=True) as dispatcher:
        held = await dispatcher.trigger("job")
        ran = await dispatcher.run_now(held.id, "ops")
        assert ran.state is S.ENQUEUED and ran.published_at is not None
    delivered = await bus.consumer("w1", ["default"]).read(10, 500)
    assert [d.envelope.instance_id for d in delivered] == [held.id]


async def test_a_run_now_the_bus_cannot_take_is_left_unmarked_for_the_sweep(
    store: SqlStore, bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The send fails: the instance is Enqueued, its mark cleared (the sweep publishes it
    after its short grace), and the answer says so."""
    await define(store, "job")
    held = await Dispatcher(store, bus, hold_triggered=True).trigger("job")

    async def away(envelopes: Sequence[tuple[str, Envelope]]) -> None:
        raise BusUnavailableError("redis is away")

    monkeypatch.setattr(bus, "publish", away)
    ran = await Dispatcher(store, bus).run_now(held.id, "ops")
    assert ran.state is S.ENQUEUED and ran.published_at is None
    stored = await store.get_instance(held.id)
    assert stored.state is S.ENQUEUED and stored.published_at is None


async def _fired(store: SqlStore, *, published: bool) -> tuple[list[NewInstance], list[Instance]]:
    """A leader's fire of one on-time tick and one missed tick (recorded Skipped)."""
    await define(store, "tick", cron="* * * * * *")
    lease = await store.acquire_leadership(0, "s1", 30)
    assert lease is not None
    tick = (await store.now()).replace(microsecond=0)
    records = [
        NewInstance(
            job_key="tick",
            source=InstanceSource.CRON,
            scheduled_at=tick - timedelta(seconds=1),
            skip_reason="misfire",
        ),
        NewInstance(job_key="tick", source=InstanceSource.CRON, scheduled_at=tick),
    ]
    return records, await store.fire(lease, records, published=published)


async def test_a_fired_tick_goes_out_once_with_its_publication_recorded(
    store: SqlStore, bus: Bus
) -> None:
    """A fire asked to record the publication (both stores do it in the insert) is sent as it
    is; the missed tick is neither marked nor sent."""
    records, instances = await _fired(store, published=True)
    skipped, enqueued = instances
    assert (skipped.state, enqueued.state) == (S.SKIPPED, S.ENQUEUED)
    assert skipped.published_at is None
    assert enqueued.published_at is not None  # recorded by the insert itself
    await Dispatcher(store, bus).publish_created(instances, {r.id for r in records})
    assert (await store.get_instance(enqueued.id)).published_at is not None
    assert (await store.get_instance(skipped.id)).published_at is None
    delivered = await bus.consumer("w1", ["default"]).read(10, 500)
    assert [d.envelope.instance_id for d in delivered] == [enqueued.id]


async def test_a_fired_tick_the_bus_cannot_take_is_left_unmarked_for_the_sweep(
    store: SqlStore, bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    records, instances = await _fired(store, published=True)
    dispatcher = Dispatcher(store, bus)

    async def away(envelopes: Sequence[tuple[str, Envelope]]) -> None:
        raise BusUnavailableError("redis is away")

    monkeypatch.setattr(bus, "publish", away)
    await dispatcher.publish_created(instances, {r.id for r in records})
    assert (await store.get_instance(instances[1].id)).published_at is None
    assert not dispatcher.marks_first  # the next fire leaves the mark to the send


async def test_a_tick_s_messages_made_ready_before_it_are_sent_as_made(
    store: SqlStore, bus: Bus
) -> None:
    """A tick written ahead has its messages encoded before its commit; at the tick they are
    appended as they are: the same entries a publish would make."""
    records, instances = await _fired(store, published=True)
    dispatcher = Dispatcher(store, bus)
    ready = dispatcher.prepare_created(instances, {r.id for r in records})
    assert ready.entries is not None and len(ready.entries) == 1  # (the other one: Skipped)
    await dispatcher.publish_prepared(ready)
    [delivered] = await bus.consumer("w1", ["default"]).read(10, 500)
    assert delivered.envelope == envelope_for(instances[1])


async def test_a_tick_s_messages_made_ready_the_bus_cannot_take_are_left_for_the_sweep(
    store: SqlStore, bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    records, instances = await _fired(store, published=True)
    dispatcher = Dispatcher(store, bus)
    ready = dispatcher.prepare_created(instances, {r.id for r in records})

    async def away(entries: Sequence[tuple[str, bytes]]) -> None:
        raise BusUnavailableError("redis is away")

    monkeypatch.setattr(bus, "publish_encoded", away)
    await dispatcher.publish_prepared(ready)
    assert (await store.get_instance(instances[1].id)).published_at is None
    assert not dispatcher.marks_first


async def test_a_fire_not_asked_to_record_the_publication_does_not(
    store: SqlStore, bus: Bus
) -> None:
    records, instances = await _fired(store, published=False)
    assert [i.published_at for i in instances] == [None, None]
    await Dispatcher(store, bus).publish_created(instances, {r.id for r in records})
    assert (await store.get_instance(instances[1].id)).published_at is not None


def test_a_schema_s_validator_is_built_once_and_never_serves_another_schema() -> None:
    """Validators are kept by schema object: the same object (a remembered definition's) gets
    the same validator; an equal schema read again, or another job's, gets its own and is
    judged by its own rules; past the cache's size the oldest goes."""
    integer = {"type": "object", "properties": {"n": {"type": "integer"}}}
    text = {"type": "object", "properties": {"n": {"type": "string"}}}
    assert triggering._validator(integer) is triggering._validator(integer)
    assert triggering._validator(dict(integer)) is not triggering._validator(integer)
    triggering.validate_args(integer, {"n": 1})
    triggering.validate_args(text, {"n": "one"})
    with pytest.raises(InvalidArgumentsError) as info:
        triggering.validate_args(text, {"n": 1})
    assert info.value.field == "args.n"
    with pytest.raises(InvalidArgumentsError) as info:
        triggering.validate_args(integer, {"n": "one"})
    assert info.value.field == "args.n"
    kept = [{"type": "object", "title": str(n)} for n in range(triggering.VALIDATORS_KEPT + 5)]
    for schema in kept:
        triggering.validate_args(schema, {})
    assert len(triggering._VALIDATORS) == triggering.VALIDATORS_KEPT
    assert id(kept[0]) not in triggering._VALIDATORS
    assert triggering._VALIDATORS[id(kept[-1])][0] is kept[-1]
