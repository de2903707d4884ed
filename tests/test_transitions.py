"""The side effects of every move between instance states, as data (``domain/transitions.py``),
and the statements that write them: the generic move on both backends, and the hand-written
Postgres claim and completion statements, run on a real database and checked against the
table column by column."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from uuid import UUID

import pytest
from sqlalchemy import func, select, update

from jobplane.domain.models import Outcome
from jobplane.domain.states import TERMINAL_STATES, TRANSITIONS, InstanceState
from jobplane.domain.transitions import EFFECTS, Effects, SlotChange, effects_of
from jobplane.errors import IllegalTransitionError
from jobplane.store.moves import NewAttempt, move_instances
from jobplane.store.postgres_sql import COMPLETE
from jobplane.store.sql import SqlStore
from jobplane.store.tables import instance_transitions, job_instances, runaway_slots
from tests.store_helpers import define, enqueue, slots_used

S = InstanceState
EDGES = sorted((a, b) for a, targets in TRANSITIONS.items() for b in targets)


# --- the table itself ----------------------------------------------------------------------


def test_every_legal_move_has_an_entry_and_no_other() -> None:
    assert sorted(EFFECTS) == EDGES


@pytest.mark.parametrize(("from_state", "to_state"), EDGES)
def test_effects_follow_the_rules(from_state: S, to_state: S) -> None:
    effects = effects_of(from_state, to_state)
    assert effects.sets_finished_at == (to_state in TERMINAL_STATES)
    assert effects.clears_published_at == (to_state is S.ENQUEUED)
    assert effects.clears_lease == (from_state is S.PROCESSING)
    assert effects.starts_attempt == (to_state is S.PROCESSING)
    expected_slot = (
        SlotChange.TAKE
        if to_state is S.PROCESSING
        else SlotChange.RETURN
        if from_state is S.PROCESSING
        else SlotChange.NONE
    )
    assert effects.slot is expected_slot
    touches_attempt = S.PROCESSING in (from_state, to_state) or from_state is S.FAILED
    assert effects.records_claim_token == touches_attempt


def test_illegal_moves_have_no_effects() -> None:
    with pytest.raises(IllegalTransitionError):
        effects_of(S.SUCCEEDED, S.ENQUEUED)
    with pytest.raises(IllegalTransitionError):
        effects_of(S.SCHEDULED, S.PROCESSING)


# --- checking a statement against the table ------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    row: dict[str, Any]
    used: int
    last: dict[str, Any] | None  # the instance's latest history record
    runaways: int


async def snapshot(store: SqlStore, instance_id: UUID) -> Snapshot:
    async with store.engine.connect() as conn:
        row = (
            (await conn.execute(select(job_instances).where(job_instances.c.id == instance_id)))
            .one()
            ._mapping
        )
        latest = (
            await conn.execute(
                select(instance_transitions)
                .where(instance_transitions.c.instance_id == instance_id)
                .order_by(instance_transitions.c.seq.desc())
                .limit(1)
            )
        ).first()
        runaways: int = (
            await conn.execute(
                select(func.count()).where(runaway_slots.c.instance_id == instance_id)
            )
        ).scalar_one()  # a count: always one row
    last = None if latest is None else dict(latest._mapping)
    return Snapshot(dict(row), await slots_used(store, row["job_key"]), last, runaways)


def assert_follows_table(
    before: Snapshot, after: Snapshot, effects: Effects, *, slot_held: bool = False
) -> None:
    """``after`` differs from ``before`` in the columns, slot counter and history the table
    gives ``effects``, and in no other way among those."""
    old, new = before.row, after.row
    assert effects is effects_of(S(old["state"]), S(new["state"]))
    if effects.sets_finished_at:
        assert new["finished_at"] is not None
    else:
        assert new["finished_at"] == old["finished_at"]
    if effects.clears_published_at:
        assert new["published_at"] is None
    else:
        assert new["published_at"] == old["published_at"]
    if effects.starts_attempt:
        assert new["claim_token"] is not None and new["claim_token"] != old["claim_token"]
        assert new["attempt"] == old["attempt"] + 1
        assert new["started_at"] is not None and new["lease_expires_at"] is not None
        assert new["progress"] is None and new["progress_message"] is None
    else:
        for column in ("claim_token", "attempt", "started_at", "worker_id"):
            assert new[column] == old[column], column
        if effects.clears_lease:
            assert new["lease_expires_at"] is None
        else:
            assert new["lease_expires_at"] == old["lease_expires_at"]
    change = 0 if slot_held else effects.slot.value
    assert after.used - before.used == change
    assert after.runaways - before.runaways == (1 if slot_held else 0)
    assert after.last is not None and after.last != before.last
    assert (after.last["from_state"], after.last["to_state"]) == (old["state"], new["state"])
    assert after.last["reason"] == new["reason"]
    expected_token = new["claim_token"] if effects.records_claim_token else None
    assert after.last["claim_token"] == expected_token


async def mark_published(store: SqlStore, instance_id: UUID) -> None:
    """Give the row a ``published_at``, so a move that keeps it is told from one clearing it."""
    async with store.engine.begin() as conn:
        await conn.execute(
            update(job_instances)
            .where(job_instances.c.id == instance_id)
            .values(published_at=store._clock())
        )


async def reach(store: SqlStore, state: S) -> UUID:
    """A fresh instance of ``job`` in ``state`` (one of the states a move leaves)."""
    [inst] = await enqueue(store, held=state is S.SCHEDULED)
    if state in (S.PROCESSING, S.FAILED):
        [claim] = (await store.claim([inst.id], "w1", 30, ["job"])).claimed
        assert claim.instance.state is S.PROCESSING
    if state is S.FAILED:
        async with store.engine.begin() as conn:
            await move_instances(
                conn, store._clock(), [inst.id], S.PROCESSING, S.FAILED, actor=None, reason="x"
            )
    assert (await store.get_instance(inst.id)).state is state
    await mark_published(store, inst.id)
    return inst.id


# --- the generic move, on both backends ----------------------------------------------------


@pytest.mark.parametrize(("from_state", "to_state"), EDGES)
async def test_move_instances_writes_what_the_table_says(
    store: SqlStore, from_state: S, to_state: S
) -> None:
    await define(store, "job", max_concurrency=5)
    instance_id = await reach(store, from_state)
    before = await snapshot(store, instance_id)
    async with store.engine.begin() as conn:
        now = await store._now(conn)
        attempt = (
            NewAttempt("w2", {instance_id: 10_000}, now, now + timedelta(seconds=30))
            if to_state is S.PROCESSING
            else None
        )
        moved = await move_instances(
            conn,
            store._clock(),
            [instance_id],
            from_state,
            to_state,
            actor="t",
            reason="because",
            attempt=attempt,
        )
    assert [i.state for i in moved] == [to_state]
    after = await snapshot(store, instance_id)
    assert_follows_table(before, after, EFFECTS[from_state, to_state])
    assert after.last is not None and after.last["actor"] == "t"


async def test_only_a_run_now_may_record_its_publication_in_its_move(store: SqlStore) -> None:
    """A move to Enqueued clears the publication (the message is to be sent again). Run now
    (Scheduled → Enqueued) may record it instead, as its caller sends the message at once; a
    release or a retry may not: their columns are the table's."""
    await define(store, "job", max_concurrency=5)
    held = await reach(store, S.SCHEDULED)
    running = await reach(store, S.PROCESSING)
    failed = await reach(store, S.FAILED)
    marked = {"published_at": store._clock()}
    async with store.engine.begin() as conn:
        [ran] = await move_instances(
            conn,
            store._clock(),
            [held],
            S.SCHEDULED,
            S.ENQUEUED,
            actor="t",
            reason=None,
            values=marked,
        )
        assert ran.published_at is not None
        for instance_id, from_state in ((running, S.PROCESSING), (failed, S.FAILED)):
            with pytest.raises(ValueError, match="published_at"):
                await move_instances(
                    conn,
                    store._clock(),
                    [instance_id],
                    from_state,
                    S.ENQUEUED,
                    actor="t",
                    reason=None,
                    values=marked,
                )


async def test_move_instances_is_a_compare_and_set(store: SqlStore) -> None:
    await define(store, "job")
    instance_id = await reach(store, S.ENQUEUED)
    before = await snapshot(store, instance_id)
    async with store.engine.begin() as conn:
        # Moved from a state it is not in, or fenced by a token it does not hold: nothing.
        assert not await move_instances(
            conn, store._clock(), [instance_id], S.SCHEDULED, S.CANCELLED, actor="t", reason=None
        )
        assert not await move_instances(
            conn,
            store._clock(),
            [instance_id],
            S.ENQUEUED,
            S.CANCELLED,
            actor="t",
            reason=None,
            claim_token=12345,
        )
    assert await snapshot(store, instance_id) == before


async def test_move_instances_keeps_a_runaways_slot(store: SqlStore) -> None:
    await define(store, "job")
    instance_id = await reach(store, S.PROCESSING)
    before = await snapshot(store, instance_id)
    async with store.engine.begin() as conn:
        await move_instances(
            conn,
            store._clock(),
            [instance_id],
            S.PROCESSING,
            S.SUCCEEDED,
            actor=None,
            reason=None,
            holds_slot=True,
        )
    after = await snapshot(store, instance_id)
    assert_follows_table(before, after, EFFECTS[S.PROCESSING, S.SUCCEEDED], slot_held=True)
    assert after.last is not None and after.last["actor"] == "w1"  # the attempt's worker


async def test_move_instances_lets_a_pending_cancel_win(store: SqlStore) -> None:
    await define(store, "job")
    instance_id = await reach(store, S.PROCESSING)
    await store.request_cancel(instance_id, "ops")
    before = await snapshot(store, instance_id)
    async with store.engine.begin() as conn:
        [moved] = await move_instances(
            conn,
            store._clock(),
            [instance_id],
            S.PROCESSING,
            S.FAILED,
            actor=None,
            reason="boom",
            cancel_reason="cancel wins",
        )
    assert moved.state is S.CANCELLED and moved.reason == "cancel wins"
    after = await snapshot(store, instance_id)
    assert_follows_table(before, after, EFFECTS[S.PROCESSING, S.CANCELLED])


# --- the Postgres hot paths, checked against the table ------------------------------------


async def test_claim_statement_follows_the_table(pg_store: SqlStore) -> None:
    await define(pg_store, "job", max_concurrency=1, on_limit="skip")
    first = await reach(pg_store, S.ENQUEUED)
    second = await reach(pg_store, S.ENQUEUED)
    doomed = await reach(pg_store, S.ENQUEUED)
    async with pg_store.engine.begin() as conn:
        await conn.execute(
            update(job_instances).where(job_instances.c.id == doomed).values(cancel_requested=True)
        )
    # One claim per move, so each sees the slot counter change of its own move only: the
    # first takes the only slot, the second finds it taken (skipped), the third is cancelled.
    for instance_id, to_state in (
        (first, S.PROCESSING),
        (second, S.SKIPPED),
        (doomed, S.CANCELLED),
    ):
        before = await snapshot(pg_store, instance_id)
        await pg_store.claim([instance_id], "w1", 30, ["job"])
        after = await snapshot(pg_store, instance_id)
        assert S(after.row["state"]) is to_state
        assert_follows_table(before, after, EFFECTS[S.ENQUEUED, to_state])
        assert after.last is not None and after.last["actor"] == "w1"


async def run_complete(store: SqlStore, outcome: Outcome) -> None:
    """The completion statement alone (without the retry that follows a Failed outcome)."""
    params: dict[str, Any] = {
        "ids": [outcome.instance_id],
        "tokens": [outcome.claim_token],
        "states": [outcome.state.value],
        "results": [json.dumps(outcome.result)],
        "errors": [None],
        "reasons": [outcome.reason],
        "cancel_reason": "cancel wins",
        "holds": [outcome.holds_slot],
    }
    async with store.engine.begin() as conn:
        assert len((await conn.execute(COMPLETE, params)).all()) == 1


@pytest.mark.parametrize(
    ("state", "cancel", "hold"),
    [
        (S.SUCCEEDED, False, False),
        (S.FAILED, False, False),
        (S.CANCELLED, False, False),
        (S.TERMINATED, False, False),
        (S.ENQUEUED, False, False),
        (S.FAILED, True, False),  # a pending cancel wins: → Cancelled
        (S.SUCCEEDED, False, True),  # a runaway's outcome: the slot stays held
    ],
)
async def test_complete_statement_follows_the_table(
    pg_store: SqlStore, state: S, cancel: bool, hold: bool
) -> None:
    await define(pg_store, "job", max_concurrency=3)
    instance_id = await reach(pg_store, S.PROCESSING)
    if cancel:
        await pg_store.request_cancel(instance_id, "ops")
    before = await snapshot(pg_store, instance_id)
    token = before.row["claim_token"]
    await run_complete(
        pg_store, Outcome(instance_id, token, state, result={"n": 1}, reason="r", holds_slot=hold)
    )
    after = await snapshot(pg_store, instance_id)
    ended = S.CANCELLED if cancel else state
    assert S(after.row["state"]) is ended
    assert_follows_table(before, after, EFFECTS[S.PROCESSING, ended], slot_held=hold)
    assert after.last is not None and after.last["actor"] == "w1"


async def test_claim_statement_ignores_what_it_may_not_claim(pg_store: SqlStore) -> None:
    """(The table is about moves: a row the claim leaves alone keeps every column.)"""
    await define(pg_store, "job")
    instance_id = await reach(pg_store, S.SCHEDULED)
    before = await snapshot(pg_store, instance_id)
    result = await pg_store.claim([instance_id], "w1", 30, ["job"])
    assert result.ignored == [instance_id]
    assert await snapshot(pg_store, instance_id) == before
