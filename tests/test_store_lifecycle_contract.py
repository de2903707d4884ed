"""The store contract, run against Postgres and SQLite (the ``store`` fixture): instances from
their claim on (outcomes, retries, releases, cancels, slots), listing, workers and leases.
Definitions and creation are in ``test_store_contract.py``."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest

from jobplane.domain.models import (
    BulkCancel,
    ErrorInfo,
    Instance,
    InstanceFilter,
    NewInstance,
    Outcome,
    WorkerInfo,
)
from jobplane.domain.reasons import EndReason
from jobplane.domain.states import InstanceState as S
from jobplane.errors import (
    IllegalTransitionError,
    InstanceNotFoundError,
)
from jobplane.ids import new_id
from jobplane.store.sql import SqlStore
from tests.store_helpers import define, enqueue, slots_used


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


async def test_cancel_many_cancels_queued_flags_running_and_leaves_the_rest(
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
    assert done.skipped == [] and not done.more  # d ended: not selected
    # Told to stop, c stays running until its worker stops it; a cancel has nothing left to
    # change there, so another call does not select it again (it kept the next rows away).
    assert await store.cancel_many(InstanceFilter(job_key="job"), limit=1, actor="ops") == (
        BulkCancel()
    )
    last = (await store.transitions(e.id))[-1]
    assert (last.from_state, last.to_state, last.actor) == (S.SCHEDULED, S.CANCELLED, "ops")
    assert (await store.get_instance(untouched.id)).state is S.ENQUEUED
    # The running one still holds its slot and ends through its worker.
    assert await store.complete([Outcome(c.id, claims[c.id].token, S.CANCELLED)]) == {
        c.id: S.CANCELLED
    }
    ended = InstanceFilter(job_key="job", states=(S.CANCELLED, S.SUCCEEDED))
    assert await store.cancel_many(ended, limit=10, actor="ops") == BulkCancel()


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


async def test_an_instance_made_after_a_burst_of_ids_stays_in_its_creation_window(
    store: SqlStore,
) -> None:
    """A creation window bounds the ids too (UUIDv7, widened by ``ID_CLOCK_SKEW``). After a
    burst of ids (a minute of bulk triggers at ~7,000/s) an id still carries its own
    millisecond, so the window that ends a second after its creation finds the instance: ids
    that took the next millisecond whenever the last one was used had run 400 s ahead of the
    clock, past the skew, and the window missed it."""
    await define(store, "a")
    for _ in range(400_000):
        new_id()
    [made] = await store.create_instances([NewInstance(job_key="a")])
    window = InstanceFilter(created_before=made.created_at + timedelta(seconds=1))
    assert [i.id for i in (await store.list_instances(window)).items] == [made.id]


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
