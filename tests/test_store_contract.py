"""The store contract, run against Postgres and SQLite (the ``store`` fixture)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select, update

from jobplane.domain.models import (
    DefinitionChange,
    ErrorInfo,
    Instance,
    InstanceFilter,
    InstanceSource,
    NewInstance,
    Outcome,
    WorkerInfo,
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
from tests.store_helpers import define, enqueue, slots_used


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


async def test_claim_complete_and_history(store: SqlStore) -> None:
    await define(store, "job")
    [inst] = await enqueue(store)
    result = await store.claim([inst.id], "w1", 10, ["job"])
    [claim] = result.claimed
    assert claim.instance.state is S.PROCESSING and claim.instance.worker_id == "w1"
    assert claim.instance.attempt == 1 and claim.options.key == "job"
    assert claim.instance.lease_expires_at is not None
    ended = await store.complete([Outcome(inst.id, claim.token, S.SUCCEEDED, result={"ok": True})])
    assert ended == {inst.id: S.SUCCEEDED}
    done = await store.get_instance(inst.id)
    assert done.result == {"ok": True} and done.finished_at is not None
    history = await store.transitions(inst.id)
    assert [(t.from_state, t.to_state) for t in history] == [
        (None, S.ENQUEUED),
        (S.ENQUEUED, S.PROCESSING),
        (S.PROCESSING, S.SUCCEEDED),
    ]
    assert history[1].claim_token == claim.token and history[1].actor == "w1"
    assert [t.seq for t in history] == sorted(t.seq for t in history)
    assert history[0].at <= history[1].at <= history[2].at


async def test_claim_tokens_are_fresh_for_every_claim(store: SqlStore) -> None:
    await define(store, "job", max_concurrency=10)
    instances = await enqueue(store, n=5)
    result = await store.claim([i.id for i in instances], "w1", 10, ["job"])
    tokens = [c.token for c in result.claimed]
    assert len(set(tokens)) == 5


async def test_a_batch_claim_of_several_jobs_gives_each_its_own_options(store: SqlStore) -> None:
    await define(store, "job", max_concurrency=5, timeout_s=30)
    await define(store, "other", max_concurrency=5, timeout_s=60)
    made = await enqueue(store, n=3) + await enqueue(store, key="other", n=3)
    result = await store.claim([i.id for i in made], "w1", 10, ["job", "other"])
    assert len(result.claimed) == 6
    for claim in result.claimed:
        assert claim.options.key == claim.instance.job_key
        assert claim.options.timeout_s == (30 if claim.instance.job_key == "job" else 60)


async def test_claim_ignores_unknown_jobs_pinned_elsewhere_and_non_enqueued(
    store: SqlStore,
) -> None:
    await define(store, "job", max_concurrency=5)
    await define(store, "other")
    [mine] = await enqueue(store)
    [pinned] = await enqueue(store, pinned_worker="w2")
    [other] = await enqueue(store, key="other")
    [later] = await enqueue(store, run_at=(await store.now()) + timedelta(hours=1))
    result = await store.claim([mine.id, pinned.id, other.id, later.id], "w1", 10, ["job"])
    assert [c.instance.id for c in result.claimed] == [mine.id]
    assert set(result.ignored) == {pinned.id, other.id, later.id}
    result = await store.claim([pinned.id], "w2", 10, ["job"])
    assert [c.instance.id for c in result.claimed] == [pinned.id]


async def test_batch_claim_ranks_by_priority_against_free_slots(store: SqlStore) -> None:
    await define(store, "job", max_concurrency=3)
    low = await enqueue(store, n=3, priority=1)
    high = await enqueue(store, n=2, priority=9)
    result = await store.claim([i.id for i in low + high], "w1", 10, ["job"])
    claimed = {c.instance.id for c in result.claimed}
    assert claimed == {high[0].id, high[1].id, low[0].id}
    assert set(result.skipped) == {low[1].id, low[2].id}
    skipped = await store.get_instance(low[1].id)
    assert skipped.state is S.SKIPPED and skipped.reason == "max concurrency reached"


async def test_on_limit_wait_leaves_the_excess_queued_and_unpublished(store: SqlStore) -> None:
    await define(store, "job", max_concurrency=1, on_limit="wait")
    first, second = await enqueue(store, n=2)
    await store.mark_published([first.id, second.id])
    result = await store.claim([first.id, second.id], "w1", 10, ["job"])
    assert result.waiting == [second.id]
    parked = await store.get_instance(second.id)
    assert parked.state is S.ENQUEUED and parked.published_at is None
    # The slot frees: the releaser republishes the parked instance.
    await store.complete([Outcome(first.id, result.claimed[0].token, S.SUCCEEDED)])
    [again] = await store.republish_waiting(["job"], 10)
    assert again.id == second.id and again.published_at is not None
    result = await store.claim([second.id], "w1", 10, ["job"])
    assert len(result.claimed) == 1


async def test_stale_claim_token_changes_nothing_and_leaves_no_history(store: SqlStore) -> None:
    await define(store, "job")
    [inst] = await enqueue(store)
    [claim] = (await store.claim([inst.id], "w1", 10, ["job"])).claimed
    stale = claim.token + 1000
    assert await store.complete([Outcome(inst.id, stale, S.SUCCEEDED, result=1)]) == {}
    assert await store.heartbeat([(inst.id, stale)], 10) == {}
    assert (
        await store.transition(
            inst.id, S.ENQUEUED, expect=[S.PROCESSING], claim_token=stale, actor="w0"
        )
        is None
    )
    after = await store.get_instance(inst.id)
    assert after.state is S.PROCESSING and after.result is None
    assert len(await store.transitions(inst.id)) == 2
    assert await store.heartbeat([(inst.id, claim.token)], 10) == {inst.id: False}


async def test_release_frees_the_slot_and_a_new_claim_fences_the_old_one(
    store: SqlStore,
) -> None:
    await define(store, "job")
    [inst] = await enqueue(store)
    [old] = (await store.claim([inst.id], "w1", 10, ["job"])).claimed
    released = await store.transition(
        inst.id,
        S.ENQUEUED,
        expect=[S.PROCESSING],
        claim_token=old.token,
        actor="reaper",
        reason="lease expired",
    )
    assert released is not None and released.state is S.ENQUEUED
    [new] = (await store.claim([inst.id], "w2", 10, ["job"])).claimed  # slot was given back
    assert new.token != old.token and new.instance.attempt == 2
    assert await store.complete([Outcome(inst.id, old.token, S.FAILED)]) == {}
    assert await store.complete([Outcome(inst.id, new.token, S.SUCCEEDED)]) == {
        inst.id: S.SUCCEEDED
    }


async def test_failure_retries_then_terminates(store: SqlStore) -> None:
    await define(store, "job", retries=1)
    [inst] = await enqueue(store)
    [c1] = (await store.claim([inst.id], "w1", 10, ["job"])).claimed
    error = ErrorInfo("ValueError", "boom", "Traceback ...")
    ended = await store.complete(
        [Outcome(inst.id, c1.token, S.FAILED, error=error, retry_delay_s=30)]
    )
    assert ended == {inst.id: S.SCHEDULED}
    retrying = await store.get_instance(inst.id)
    assert retrying.retries_used == 1 and retrying.run_at is not None
    assert retrying.error == error
    # Promote (the scheduler's job) and run the last attempt.
    await store.transition(inst.id, S.ENQUEUED, expect=[S.SCHEDULED], actor="scheduler")
    [c2] = (await store.claim([inst.id], "w1", 10, ["job"])).claimed
    ended = await store.complete([Outcome(inst.id, c2.token, S.FAILED, error=error)])
    assert ended == {inst.id: S.TERMINATED}
    states = [t.to_state for t in await store.transitions(inst.id)]
    assert states == [
        S.ENQUEUED,
        S.PROCESSING,
        S.FAILED,
        S.SCHEDULED,
        S.ENQUEUED,
        S.PROCESSING,
        S.FAILED,
        S.TERMINATED,
    ]


async def test_retry_without_backoff_is_enqueued_at_once(store: SqlStore) -> None:
    await define(store, "job", retries=3)
    [inst] = await enqueue(store)
    [c] = (await store.claim([inst.id], "w1", 10, ["job"])).claimed
    assert await store.complete([Outcome(inst.id, c.token, S.FAILED)]) == {inst.id: S.ENQUEUED}


async def test_illegal_transitions_raise(store: SqlStore) -> None:
    await define(store, "job")
    [inst] = await enqueue(store)
    with pytest.raises(IllegalTransitionError):
        await store.transition(inst.id, S.ENQUEUED, expect=[S.SUCCEEDED], actor="x")
    [c] = (await store.claim([inst.id], "w1", 10, ["job"])).claimed
    await store.complete([Outcome(inst.id, c.token, S.SUCCEEDED)])
    with pytest.raises(IllegalTransitionError):
        await store.request_cancel(inst.id, "ops")


async def test_cancel_queued_ends_it_and_cancel_running_flags_it(store: SqlStore) -> None:
    await define(store, "job", max_concurrency=2)
    queued, running = await enqueue(store, n=2)
    cancelled = await store.request_cancel(queued.id, "ops")
    assert cancelled.state is S.CANCELLED and cancelled.finished_at is not None
    [c] = (await store.claim([running.id], "w1", 10, ["job"])).claimed
    flagged = await store.request_cancel(running.id, "ops")
    assert flagged.state is S.PROCESSING and flagged.cancel_requested
    assert await store.heartbeat([(running.id, c.token)], 10) == {running.id: True}
    await store.complete([Outcome(running.id, c.token, S.CANCELLED)])
    assert (await store.get_instance(running.id)).state is S.CANCELLED
    with pytest.raises(InstanceNotFoundError):
        await store.request_cancel(NewInstance(job_key="job").id, "ops")


async def test_a_failed_attempt_of_a_cancel_requested_instance_ends_cancelled(
    store: SqlStore,
) -> None:
    await define(store, "job", retries=3, max_concurrency=1)
    inst, other = await enqueue(store, n=2)
    [c] = (await store.claim([inst.id], "w1", 10, ["job"])).claimed
    await store.request_cancel(inst.id, "ops")
    error = ErrorInfo("TimeoutError", "timed out after 1 s", None)
    outcome = Outcome(inst.id, c.token, S.FAILED, error=error, reason="timeout")
    assert await store.complete([outcome]) == {inst.id: S.CANCELLED}
    done = await store.get_instance(inst.id)
    assert done.state is S.CANCELLED and done.retries_used == 0 and done.error == error
    assert done.finished_at is not None and done.reason == EndReason.CANCEL_WINS
    history = [(t.from_state, t.to_state, t.reason) for t in await store.transitions(inst.id)]
    assert history[-1] == (S.PROCESSING, S.CANCELLED, EndReason.CANCEL_WINS)
    assert S.FAILED not in [to for _, to, _ in history]
    # The slot went back with it.
    assert [x.instance.id for x in (await store.claim([other.id], "w1", 10, ["job"])).claimed] == [
        other.id
    ]


async def test_a_failure_without_a_cancel_request_still_retries(store: SqlStore) -> None:
    await define(store, "job", retries=1)
    [inst] = await enqueue(store)
    [c] = (await store.claim([inst.id], "w1", 10, ["job"])).claimed
    assert await store.complete([Outcome(inst.id, c.token, S.FAILED)]) == {inst.id: S.ENQUEUED}
    assert not (await store.get_instance(inst.id)).cancel_requested


async def test_claim_never_runs_an_enqueued_instance_whose_cancel_was_requested(
    store: SqlStore,
) -> None:
    await define(store, "job", retries=2)
    inst, fine = await enqueue(store, n=2)
    [c] = (await store.claim([inst.id], "w1", 10, ["job"])).claimed
    await store.request_cancel(inst.id, "ops")
    # Released by a stopping worker before it saw the cancel: Enqueued, flag still set.
    released = await store.transition(
        inst.id, S.ENQUEUED, expect=[S.PROCESSING], claim_token=c.token, actor="w1"
    )
    assert released is not None and released.cancel_requested
    result = await store.claim([inst.id, fine.id], "w2", 10, ["job"])
    assert [x.instance.id for x in result.claimed] == [fine.id]
    assert result.cancelled == [inst.id] and result.ignored == []
    done = await store.get_instance(inst.id)
    assert done.state is S.CANCELLED and done.attempt == 1 and done.finished_at is not None
    last = (await store.transitions(inst.id))[-1]
    assert (last.from_state, last.to_state, last.reason, last.actor) == (
        S.ENQUEUED,
        S.CANCELLED,
        EndReason.CANCEL_BEFORE_CLAIM,
        "w2",
    )
    # A duplicate message for it later is simply ignored.
    again = await store.claim([inst.id], "w3", 10, ["job"])
    assert again.claimed == [] and again.ignored == [inst.id]


async def test_cancel_many_cancels_queued_flags_running_and_skips_the_rest(
    store: SqlStore,
) -> None:
    await define(store, "job", max_concurrency=2)
    await define(store, "other")
    a, b, c, d = await enqueue(store, "job", 4)
    [e] = await enqueue(store, "job", run_at=(await store.now()) + timedelta(hours=1))
    [untouched] = await enqueue(store, "other")
    claims = {
        cl.instance.id: cl for cl in (await store.claim([c.id, d.id], "w1", 30, ["job"])).claimed
    }
    await store.complete([Outcome(d.id, claims[d.id].token, S.SUCCEEDED)])

    done = await store.cancel_many(InstanceFilter(job_key="job"), limit=10, actor="ops")
    assert {i.id for i in done.cancelled} == {a.id, b.id, e.id}
    assert all(i.state is S.CANCELLED and i.finished_at for i in done.cancelled)
    assert [(i.id, i.state, i.cancel_requested) for i in done.requested] == [
        (c.id, S.PROCESSING, True)
    ]
    assert done.skipped == [d.id] and not done.more
    last = (await store.transitions(e.id))[-1]
    assert (last.from_state, last.to_state, last.actor) == (S.SCHEDULED, S.CANCELLED, "ops")
    assert (await store.get_instance(untouched.id)).state is S.ENQUEUED
    # The running one still holds its slot and ends through its worker.
    assert await store.complete([Outcome(c.id, claims[c.id].token, S.CANCELLED)]) == {
        c.id: S.CANCELLED
    }
    again = await store.cancel_many(InstanceFilter(job_key="job"), limit=10, actor="ops")
    assert (again.cancelled, again.requested, len(again.skipped)) == ([], [], 5)


async def test_cancel_many_is_bounded_oldest_first(store: SqlStore) -> None:
    await define(store, "job")
    first, second, third = await enqueue(store, "job", 3)
    queued = InstanceFilter(job_key="job", states=(S.ENQUEUED,))
    done = await store.cancel_many(queued, limit=2, actor="ops")
    assert [i.id for i in done.cancelled] == [first.id, second.id] and done.more
    done = await store.cancel_many(queued, limit=2, actor="ops")
    assert [i.id for i in done.cancelled] == [third.id] and not done.more
    assert len(await store.transitions(first.id)) == 2  # created, cancelled: once


async def test_keyset_pagination_and_filters(store: SqlStore) -> None:
    await define(store, "a", max_concurrency=10)
    await define(store, "b")
    made = await enqueue(store, "a", n=7)
    await enqueue(store, "b", n=2)
    await store.claim([made[0].id], "w9", 10, ["a"])
    seen: list[str] = []
    cursor = None
    while True:
        page = await store.list_instances(InstanceFilter(job_key="a"), limit=3, before=cursor)
        seen.extend(str(i.id) for i in page.items)
        cursor = page.next_cursor
        if cursor is None:
            break
    assert seen == [str(i.id) for i in reversed(made)]
    running = await store.list_instances(InstanceFilter(states=(S.PROCESSING,)))
    assert [i.id for i in running.items] == [made[0].id]
    by_worker = await store.list_instances(InstanceFilter(worker_id="w9"))
    assert [i.id for i in by_worker.items] == [made[0].id]
    window = await store.list_instances(
        InstanceFilter(created_after=made[0].created_at - timedelta(seconds=1))
    )
    assert len(window.items) == 9
    # A window bounds the ids too (UUIDv7): still exact at its edges, and a window that ends
    # before anything was created, or lies at the calendar's ends, finds nothing.
    edge = made[3].created_at
    later = await store.list_instances(InstanceFilter(created_after=edge))
    assert {i.id for i in later.items} == {i.id for i in await _all(store) if i.created_at >= edge}
    earlier = InstanceFilter(created_before=made[0].created_at - timedelta(seconds=1))
    assert (await store.list_instances(earlier)).items == []
    extremes = InstanceFilter(
        created_after=datetime.min.replace(tzinfo=UTC),
        created_before=datetime.max.replace(tzinfo=UTC),
    )
    assert len((await store.list_instances(extremes, limit=100)).items) == 9


async def _all(store: SqlStore) -> list[Instance]:
    return (await store.list_instances(InstanceFilter(), limit=1000)).items


async def test_workers_register_and_heartbeat(store: SqlStore) -> None:
    info = WorkerInfo(
        id="w1", host="h", pid=1, queues=("default",), capacity=4, version="0.1", jobs=("job",)
    )
    await store.register_worker(info)
    await store.register_worker(info)  # a restart refreshes the same row
    await store.worker_heartbeat("w1")
    await store.worker_stopped("w1")
    [w] = await store.list_workers()
    assert w.id == "w1" and w.jobs == ("job",) and w.stopped_at is not None


async def test_leader_lease_terms(store: SqlStore) -> None:
    a = await store.acquire_leadership(0, "a", ttl_s=30)
    assert a is not None and a.term == 1
    assert await store.acquire_leadership(0, "b", ttl_s=30) is None
    renewed = await store.acquire_leadership(0, "a", ttl_s=30)
    assert renewed is not None and renewed.term == 1
    assert await store.release_leadership(0, "a", term=1)
    assert await store.get_leader(0) is None
    b = await store.acquire_leadership(0, "b", ttl_s=30)
    assert b is not None and b.term == 2
    assert not await store.release_leadership(0, "a", term=1)  # a stale leader is fenced off
    leader = await store.get_leader(0)
    assert leader is not None and leader.holder == "b"


async def test_heartbeat_extends_the_lease_and_records_progress(store: SqlStore) -> None:
    await define(store, "job")
    [inst] = await enqueue(store)
    [claim] = (await store.claim([inst.id], "w1", 1, ["job"])).claimed
    first_expiry = claim.instance.lease_expires_at
    assert first_expiry is not None
    kept = await store.heartbeat([(inst.id, claim.token)], 60, {inst.id: (0.5, "half way")})
    assert kept == {inst.id: False}
    after = await store.get_instance(inst.id)
    assert after.lease_expires_at is not None and after.lease_expires_at > first_expiry
    assert after.progress == 0.5 and after.progress_message == "half way"
    # A stale token records no progress.
    await store.heartbeat([(inst.id, claim.token + 1)], 60, {inst.id: (0.9, "late")})
    assert (await store.get_instance(inst.id)).progress == 0.5


async def test_checkpoint_is_fenced_and_survives_to_the_next_attempt(store: SqlStore) -> None:
    await define(store, "job", retries=1, backoff={"kind": "none"})
    [inst] = await enqueue(store)
    [c1] = (await store.claim([inst.id], "w1", 10, ["job"])).claimed
    assert await store.save_checkpoint(inst.id, c1.token, {"page": 7})
    assert not await store.save_checkpoint(inst.id, c1.token + 1, {"page": 99})
    await store.complete([Outcome(inst.id, c1.token, S.FAILED)])
    [c2] = (await store.claim([inst.id], "w2", 10, ["job"])).claimed
    assert c2.instance.checkpoint == {"page": 7} and c2.instance.attempt == 2
    assert not await store.save_checkpoint(inst.id, c1.token, {"page": 100})


async def _fail_holding_the_slot(store: SqlStore, worker_id: str = "w1") -> tuple[Instance, int]:
    """A job (max concurrency 1, one retry, waits for its slot) whose first attempt timed out
    while its code still runs: recorded Failed with ``holds_slot``."""
    await define(store, "job", retries=1, on_limit="wait", backoff={"kind": "none"})
    [inst] = await enqueue(store)
    [claim] = (await store.claim([inst.id], worker_id, 10, ["job"])).claimed
    error = ErrorInfo("TimeoutError", "timed out after 1 s", "")
    outcome = Outcome(
        inst.id, claim.token, S.FAILED, error=error, reason="timeout", holds_slot=True
    )
    assert await store.complete([outcome]) == {inst.id: S.ENQUEUED}  # retried at once
    return inst, claim.token


async def test_a_runaway_outcome_is_recorded_but_keeps_the_slot_until_released(
    store: SqlStore,
) -> None:
    inst, token = await _fail_holding_the_slot(store)
    assert await slots_used(store) == 1
    states = [t.to_state for t in await store.transitions(inst.id)]
    assert states == [S.ENQUEUED, S.PROCESSING, S.FAILED, S.ENQUEUED]
    # The retry finds the slot taken by the code still running: it waits (on_limit=wait).
    assert (await store.claim([inst.id], "w2", 10, ["job"])).waiting == [inst.id]
    # The thread returned: the slot goes back once, whoever asks again.
    assert await store.release_runaway_slot(inst.id, token + 1) is False  # not that attempt
    assert await store.release_runaway_slot(inst.id, token) is True
    assert await store.release_runaway_slot(inst.id, token) is False
    assert await slots_used(store) == 0
    [retry] = (await store.claim([inst.id], "w2", 10, ["job"])).claimed
    assert retry.instance.attempt == 2 and await slots_used(store) == 1
    await store.complete([Outcome(inst.id, retry.token, S.SUCCEEDED)])
    assert await slots_used(store) == 0


async def test_the_dead_worker_sweep_releases_the_slots_of_its_runaways(store: SqlStore) -> None:
    info = WorkerInfo(id="w1", host="h", pid=1, queues=("default",), capacity=1, version="x")
    await store.register_worker(info)
    inst, token = await _fail_holding_the_slot(store, "w1")
    assert await store.mark_dead_workers(60) == []  # alive: its runaway keeps the slot
    assert await slots_used(store) == 1
    await asyncio.sleep(0.2)
    assert await store.mark_dead_workers(0.1) == ["w1"]
    assert await slots_used(store) == 0
    assert await store.release_runaway_slot(inst.id, token) is False  # already given back
    assert await store.mark_dead_workers(0.1) == [] and await slots_used(store) == 0


async def test_a_restarted_worker_releases_the_slots_its_previous_process_held(
    store: SqlStore,
) -> None:
    info = WorkerInfo(id="w1", host="h", pid=1, queues=("default",), capacity=1, version="x")
    await store.register_worker(info)
    inst, token = await _fail_holding_the_slot(store, "w1")
    await store.register_worker(info)  # the same id again: the old process is gone
    assert await slots_used(store) == 0
    assert await store.release_runaway_slot(inst.id, token) is False
