"""The store contract, run against Postgres and SQLite (the ``store`` fixture): job
definitions and their versions, the creation of instances, idempotency keys. The instances'
lives from their claim on are in ``test_store_lifecycle_contract.py``."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from sqlalchemy import func, select, update

from jobplane.domain.models import (
    DefinitionChange,
    InstanceFilter,
    InstanceSource,
    NewInstance,
)
from jobplane.domain.options import JobOptions
from jobplane.domain.reasons import EndReason
from jobplane.domain.states import InstanceState as S
from jobplane.errors import (
    DefinitionVersionNotFoundError,
    IdempotencyConflictError,
    IllegalTransitionError,
    InstanceNotFoundError,
    JobNotFoundError,
    StaleDefinitionError,
)
from jobplane.ids import new_id
from jobplane.store.publication import NEVER_PUBLISHED_GRACE_S
from jobplane.store.sql import SqlStore
from jobplane.store.tables import job_instances
from tests.store_helpers import define, enqueue


async def test_first_registration_persists_then_stored_options_win(store: SqlStore) -> None:
    first = JobOptions.parse(key="report", kind="triggered", retries=2)
    stored, created = await store.register_definition(first, {"type": "object"}, "worker-a")
    assert created and stored.version == 1 and stored.options.retries == 2

    edited = await store.save_definition(first.edited(retries=5), expected_version=1, actor="admin")
    assert edited is not None and edited.version == 2

    # A later registration (code still says retries=2) keeps the edited options.
    again, created = await store.register_definition(first, {"type": "object", "x": 1}, "w-b")
    assert not created
    assert again.options.retries == 5 and again.version == 2
    assert again.args_schema == {"type": "object", "x": 1}


async def test_registration_records_the_app_and_lists_filter_by_it(store: SqlStore) -> None:
    shop = JobOptions.parse(key="receipt", kind="triggered")
    billing = JobOptions.parse(key="invoice", kind="triggered")
    stored, _ = await store.register_definition(shop, None, "w", app="shop")
    assert stored.app == "shop"
    await store.register_definition(billing, None, "w", app="billing")
    # The app follows the code that registers the job; a registration without one keeps it.
    moved, _ = await store.register_definition(shop, None, "w", app="storefront")
    assert moved.app == "storefront"
    kept, _ = await store.register_definition(shop, None, "w")
    assert kept.app == "storefront"
    assert [d.key for d in await store.list_definitions(app="storefront")] == ["receipt"]
    assert [d.key for d in await store.list_definitions(app="billing")] == ["invoice"]
    assert await store.list_definitions(app="shop") == []

    [r] = await enqueue(store, "receipt")
    [i] = await enqueue(store, "invoice")
    only = await store.list_instances(InstanceFilter(job_keys=("receipt",)))
    assert [x.id for x in only.items] == [r.id]
    both = await store.list_instances(InstanceFilter(job_keys=("receipt", "invoice")))
    assert {x.id for x in both.items} == {r.id, i.id}
    assert (await store.list_instances(InstanceFilter(job_keys=()))).items == []


async def test_save_definition_is_an_optimistic_lock(store: SqlStore) -> None:
    opts = await define(store, "job")
    assert await store.save_definition(opts.edited(retries=1), expected_version=1, actor="a")
    assert (
        await store.save_definition(opts.edited(retries=2), expected_version=1, actor="b") is None
    )
    assert (await store.get_definition("job")).options.retries == 1


async def test_pause_bumps_version_and_unknown_key_raises(store: SqlStore) -> None:
    await define(store, "tick", cron="* * * * *")
    paused = await store.set_paused("tick", True, "ops")
    assert paused.paused and paused.version == 2
    assert await store.definition_versions() == {"tick": 2}
    with pytest.raises(JobNotFoundError) as info:
        await store.set_paused("nope", True, "ops")
    assert info.value.key == "nope"
    with pytest.raises(JobNotFoundError):
        await store.get_definition("nope")


async def test_every_save_is_a_version_and_rollback_appends_one(store: SqlStore) -> None:
    opts = await define(store, "job", retries=1)
    await store.register_definition(opts.edited(retries=9), None, "worker-b")  # not a save
    assert await store.save_definition(opts.edited(retries=2), expected_version=1, actor="ann")
    await store.set_paused("job", True, "ops")
    await store.set_paused("job", False, "ops")
    rolled = await store.rollback_definition("job", 1, expected_version=4, actor="bob")
    assert rolled is not None and rolled.version == 5 and rolled.options.retries == 1
    assert rolled.updated_by == "bob" and not rolled.paused

    history = await store.definition_history("job")
    assert [(v.version, v.action, v.actor) for v in history] == [
        (5, DefinitionChange.ROLLBACK, "bob"),
        (4, DefinitionChange.RESUME, "ops"),
        (3, DefinitionChange.PAUSE, "ops"),
        (2, DefinitionChange.EDIT, "ann"),
        (1, DefinitionChange.REGISTER, "test"),
    ]
    assert [v.options.retries for v in history] == [1, 2, 2, 2, 1]
    assert [v.paused for v in history] == [False, False, True, False, False]
    assert history[0].rolled_back_to == 1 and history[1].rolled_back_to is None
    assert history[0].at >= history[-1].at
    assert (await store.get_definition("job")).options == history[-1].options


async def test_rollback_is_an_optimistic_lock_and_checks_the_version(store: SqlStore) -> None:
    opts = await define(store, "job")
    await store.save_definition(opts.edited(retries=3), expected_version=1, actor="a")
    assert await store.rollback_definition("job", 1, expected_version=1, actor="b") is None
    with pytest.raises(DefinitionVersionNotFoundError) as info:
        await store.rollback_definition("job", 7, expected_version=2, actor="b")
    assert (info.value.key, info.value.version) == ("job", 7)
    with pytest.raises(JobNotFoundError):
        await store.rollback_definition("nope", 1, expected_version=1, actor="b")
    with pytest.raises(JobNotFoundError):
        await store.definition_history("nope")
    # Nothing that failed left a version behind.
    assert [v.version for v in await store.definition_history("job")] == [2, 1]
    assert (await store.get_definition("job")).options.retries == 3


async def test_create_instances_initial_states_and_history(store: SqlStore) -> None:
    await define(store, "job", priority=3, queue="mail")
    now = await store.now()
    enq, delayed, held, past, skipped = await store.create_instances(
        [
            NewInstance(job_key="job", args={"n": 1}),
            NewInstance(job_key="job", run_at=now + timedelta(hours=1)),
            NewInstance(job_key="job", held=True),
            NewInstance(job_key="job", run_at=now - timedelta(seconds=5)),
            NewInstance(job_key="job", skip_reason="misfire"),
        ]
    )
    assert enq.state is S.ENQUEUED and enq.args == {"n": 1}
    assert enq.queue == "mail" and enq.priority == 3
    assert delayed.state is S.SCHEDULED and delayed.run_at is not None
    assert held.state is S.SCHEDULED and held.run_at is None
    assert past.state is S.ENQUEUED
    assert skipped.state is S.SKIPPED and skipped.reason == "misfire"
    assert enq.id < delayed.id < held.id  # time-ordered ids
    [creation] = await store.transitions(skipped.id)
    assert creation.from_state is None and creation.to_state is S.SKIPPED
    assert creation.reason == "misfire"


async def test_create_published_writes_one_instance_marked_published(store: SqlStore) -> None:
    """The single-trigger write: the instance, its creation history, and (Enqueued only) its
    publication, together; held and delayed instances are not published."""
    await define(store, "job", priority=3, queue="mail")
    definition = await store.get_definition("job")
    now = await store.now()
    enq = await store.create_published(NewInstance(job_key="job", args={"n": 1}), definition)
    assert enq.state is S.ENQUEUED and enq.args == {"n": 1} and enq.published_at is not None
    assert enq.queue == "mail" and enq.priority == 3
    assert enq == await store.get_instance(enq.id)
    [creation] = await store.transitions(enq.id)
    assert creation.from_state is None and creation.to_state is S.ENQUEUED
    delayed = await store.create_published(
        NewInstance(job_key="job", run_at=now + timedelta(hours=1)), definition
    )
    held = await store.create_published(NewInstance(job_key="job", held=True), definition)
    assert delayed.state is S.SCHEDULED and delayed.run_at is not None
    assert held.state is S.SCHEDULED and held.run_at is None
    assert delayed.published_at is None and held.published_at is None


async def test_create_published_refuses_a_definition_that_moved_on(store: SqlStore) -> None:
    """Validated against version 1, the job was disabled since (version 2): nothing is
    written, and the caller is told to decide again; an unknown job likewise."""
    await define(store, "job")
    current = await store.get_definition("job")
    edited = await store.save_definition(
        current.options.edited(disabled=True), expected_version=current.version, actor="t"
    )
    assert edited is not None
    with pytest.raises(StaleDefinitionError) as info:
        await store.create_published(NewInstance(job_key="job"), current)
    assert info.value.key == "job" and info.value.version == current.version
    with pytest.raises(StaleDefinitionError):
        await store.create_published(NewInstance(job_key="nope"), current)
    # A worker's registration replaces the argument schema and keeps the version.
    options = JobOptions.parse(key="other", kind="triggered")
    registered, _ = await store.register_definition(options, {"type": "object"}, "w1")
    again, _ = await store.register_definition(options, {"type": "array"}, "w2")
    assert again.version == registered.version
    with pytest.raises(StaleDefinitionError):
        await store.create_published(NewInstance(job_key="other"), registered)
    assert (await store.list_instances(InstanceFilter())).items == []
    made = await store.create_published(NewInstance(job_key="other", args=[]), again)
    assert made.state is S.ENQUEUED


async def test_create_published_replays_an_idempotency_key(store: SqlStore) -> None:
    await define(store, "job")
    definition = await store.get_definition("job")
    first = await store.create_published(
        NewInstance(job_key="job", args={"n": 1}, idempotency_key="k"), definition
    )
    again = await store.create_published(
        NewInstance(job_key="job", args={"n": 1}, idempotency_key="k"), definition
    )
    assert again.id == first.id
    with pytest.raises(IdempotencyConflictError):
        await store.create_published(
            NewInstance(job_key="job", args={"n": 2}, idempotency_key="k"), definition
        )
    assert len((await store.list_instances(InstanceFilter())).items) == 1


async def test_publication_marks_of_a_batch_beyond_a_statements_parameters(
    pg_store: SqlStore,
) -> None:
    # A batch trigger of the Python API may name more instances than one statement takes
    # parameters (32,767): they are marked, and unmarked, in slices.
    await define(pg_store, "job")
    made = await enqueue(pg_store, n=33_000)
    await pg_store.mark_published([i.id for i in made])
    assert await pg_store.unpublished(older_than_s=3600) == []
    await pg_store.unmark_published([i.id for i in made])
    async with pg_store.engine.connect() as conn:
        marked = await conn.scalar(
            select(func.count()).where(job_instances.c.published_at.is_not(None))
        )
    assert marked == 0


async def test_unmark_published_leaves_it_to_the_sweep(store: SqlStore) -> None:
    """A publication that never reached the bus is forgotten: the instance is found by the
    sweep's never-published query once its grace is over."""
    await define(store, "job")
    definition = await store.get_definition("job")
    made = await store.create_published(NewInstance(job_key="job"), definition)
    assert await store.unpublished(older_than_s=3600) == []
    await store.unmark_published([made.id])
    assert (await store.get_instance(made.id)).published_at is None
    await asyncio.sleep(NEVER_PUBLISHED_GRACE_S + 0.1)
    assert [i.id for i in await store.unpublished(older_than_s=3600)] == [made.id]


async def test_run_now_moves_a_waiting_instance_once(store: SqlStore) -> None:
    await define(store, "job")
    now = await store.now()
    held, delayed, queued = await store.create_instances(
        [
            NewInstance(job_key="job", held=True),
            NewInstance(job_key="job", run_at=now + timedelta(hours=1)),
            NewInstance(job_key="job"),
        ]
    )
    ran = await store.run_now(held.id, "ops")
    assert ran.state is S.ENQUEUED and ran.run_at is not None and ran.published_at is None
    moved = (await store.transitions(held.id))[-1]
    assert (moved.from_state, moved.to_state, moved.actor) == (S.SCHEDULED, S.ENQUEUED, "ops")
    assert moved.reason == EndReason.RUN_BY_HAND
    started = await store.run_now(delayed.id, "ops")
    assert started.run_at is not None and started.run_at < now + timedelta(minutes=1)
    # Compare-and-set on Scheduled: a second run (or a run of a queued instance) changes nothing.
    for already in (held, queued):
        with pytest.raises(IllegalTransitionError):
            await store.run_now(already.id, "ops")
    assert len(await store.transitions(held.id)) == 2
    with pytest.raises(InstanceNotFoundError):
        await store.run_now(new_id(), "ops")
    # Asked to, the move records the publication too (one write, as a trigger's insert).
    [later] = await store.create_instances([NewInstance(job_key="job", held=True)])
    marked = await store.run_now(later.id, "ops", published=True)
    assert marked.state is S.ENQUEUED and marked.published_at is not None
    assert (await store.get_instance(later.id)).published_at == marked.published_at


async def test_unknown_job_inserts_nothing(store: SqlStore) -> None:
    await define(store, "job")
    with pytest.raises(JobNotFoundError):
        await store.create_instances([NewInstance(job_key="job"), NewInstance(job_key="ghost")])
    assert await store.count_by_state() == {}


async def test_cron_occurrence_is_unique_but_manual_triggers_are_not(store: SqlStore) -> None:
    await define(store, "tick", cron="* * * * * *")
    tick = (await store.now()).replace(microsecond=0)
    first = await store.create_instances(
        [NewInstance(job_key="tick", source=InstanceSource.CRON, scheduled_at=tick)]
    )
    # A second scheduler that believes it leads fires the same tick: nothing new is created.
    again = await store.create_instances(
        [NewInstance(job_key="tick", source=InstanceSource.CRON, scheduled_at=tick)]
    )
    assert again[0].id == first[0].id
    manual = await store.create_instances(
        [NewInstance(job_key="tick", scheduled_at=tick), NewInstance(job_key="tick")]
    )
    assert len({i.id for i in manual}) == 2
    assert sum((await store.count_by_state("tick")).values()) == 3
    assert len(await store.transitions(first[0].id)) == 1  # no history for the duplicate


async def test_idempotency_key_returns_the_first_instance(store: SqlStore) -> None:
    await define(store, "job")
    [a] = await enqueue(store, idempotency_key="order-42")
    [b] = await enqueue(store, idempotency_key="order-42")
    assert a.id == b.id
    assert a.idempotency_fingerprint is not None


async def test_idempotency_key_reused_for_another_request_creates_nothing(
    store: SqlStore,
) -> None:
    await define(store, "job")
    await define(store, "other")
    [a] = await enqueue(store, args={"n": 1}, idempotency_key="k")
    for key, kw in (
        ("job", {"args": {"n": 2}}),
        ("job", {"args": {"n": 1}, "priority": 1}),
        ("job", {"args": {"n": 1}, "pinned_worker": "w"}),
        ("other", {"args": {"n": 1}}),
    ):
        with pytest.raises(IdempotencyConflictError) as info:
            # With a fresh key first: the whole batch rolls back, the fresh one included.
            await store.create_instances(
                [
                    NewInstance(job_key="job", idempotency_key="fresh"),
                    NewInstance(job_key=key, idempotency_key="k", **kw),
                ]
            )
        assert info.value.key == "k"
    assert [i.id for i in (await store.list_instances(InstanceFilter())).items] == [a.id]


async def test_a_key_used_before_fingerprints_is_compared_on_what_is_stored(
    store: SqlStore,
) -> None:
    """Instances created before migration 0006 have no fingerprint: the job, arguments and
    pinned worker stored decide, as under the old per-job unique index."""
    await define(store, "job")
    await define(store, "other")
    [old] = await enqueue(store, args={"n": 1}, idempotency_key="legacy")
    async with store.engine.begin() as conn:
        await conn.execute(
            update(job_instances)
            .where(job_instances.c.id == old.id)
            .values(idempotency_fingerprint=None)
        )
    [same] = await enqueue(store, args={"n": 1}, priority=2, idempotency_key="legacy")
    assert same.id == old.id
    with pytest.raises(IdempotencyConflictError):
        await enqueue(store, args={"n": 2}, idempotency_key="legacy")
    # Another job was free to use the key then (the old index was per job): it still is.
    [elsewhere] = await enqueue(store, "other", args={"n": 1}, idempotency_key="legacy")
    assert elsewhere.id != old.id and elsewhere.job_key == "other"
