"""The store contract of a worker's fenced release (its fence stopped an attempt whose lease
it could not renew), run against Postgres and SQLite: counted as the reaper counts an expired
lease, and fenced by the claim token."""

from __future__ import annotations

from jobplane.domain.models import Outcome
from jobplane.domain.reasons import EndReason, StopReason
from jobplane.domain.states import InstanceState as S
from jobplane.store.sql import SqlStore
from tests.store_helpers import define, enqueue, slots_used


async def test_a_fenced_release_counts_an_unexpected_retry_then_terminates(
    store: SqlStore,
) -> None:
    await define(store, "job", max_unexpected_retries=1, max_concurrency=1)
    [inst] = await enqueue(store)
    [c1] = (await store.claim([inst.id], "w1", 10, ["job"])).claimed
    released = await store.release_fenced(inst.id, c1.token, actor="w1", reason="lease lost")
    assert released is not None and released.state is S.ENQUEUED
    assert released.unexpected_retries_used == 1 and released.retries_used == 0
    assert await slots_used(store) == 0  # the slot went back with the release
    # Its token no longer holds: a second release of the same attempt changes nothing.
    assert await store.release_fenced(inst.id, c1.token, actor="w1", reason="lease lost") is None
    [c2] = (await store.claim([inst.id], "w2", 10, ["job"])).claimed
    ended = await store.release_fenced(inst.id, c2.token, actor="w2", reason="lease lost")
    assert ended is not None and ended.state is S.TERMINATED
    assert ended.reason == EndReason.EXHAUSTED and ended.unexpected_retries_used == 1
    assert await slots_used(store) == 0
    history = await store.transitions(inst.id)
    moves = [(t.from_state, t.to_state, t.reason, t.actor) for t in history]
    assert moves[-3:] == [
        (S.PROCESSING, S.ENQUEUED, StopReason.LEASE_LOST, "w1"),
        (S.ENQUEUED, S.PROCESSING, None, "w2"),
        (S.PROCESSING, S.TERMINATED, EndReason.EXHAUSTED, "w2"),
    ]


async def test_a_fenced_release_of_an_instance_whose_cancel_is_pending_cancels_it(
    store: SqlStore,
) -> None:
    await define(store, "job")
    [inst] = await enqueue(store)
    [claim] = (await store.claim([inst.id], "w1", 10, ["job"])).claimed
    await store.request_cancel(inst.id, "ops")
    ended = await store.release_fenced(inst.id, claim.token, actor="w1", reason="lease lost")
    assert ended is not None and ended.state is S.CANCELLED
    assert ended.unexpected_retries_used == 0
    assert await slots_used(store) == 0


async def test_a_fenced_release_after_the_attempt_ended_or_was_reclaimed_writes_nothing(
    store: SqlStore,
) -> None:
    await define(store, "job")
    [inst] = await enqueue(store)
    [old] = (await store.claim([inst.id], "w1", 10, ["job"])).claimed
    await store.transition(
        inst.id, S.ENQUEUED, expect=[S.PROCESSING], claim_token=old.token, actor="scheduler"
    )
    [new] = (await store.claim([inst.id], "w2", 10, ["job"])).claimed
    before = len(await store.transitions(inst.id))
    assert await store.release_fenced(inst.id, old.token, actor="w1", reason="lease lost") is None
    await store.complete([Outcome(inst.id, new.token, S.SUCCEEDED)])
    assert await store.release_fenced(inst.id, new.token, actor="w2", reason="lease lost") is None
    done = await store.get_instance(inst.id)
    assert done.state is S.SUCCEEDED and done.unexpected_retries_used == 0
    assert len(await store.transitions(inst.id)) == before + 1  # only the outcome
