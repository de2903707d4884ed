"""Moving instances from one state to another, with the side effects of
:data:`jobplane.domain.transitions.EFFECTS`.

:func:`move_instances` is the one generic move: a single conditional UPDATE for the whole
batch (compare-and-set on the state, and on the claim token for an attempt's own writes), the
side-effect columns derived from the table, then the slot changes and the history records,
all in the caller's transaction. The Postgres claim and completion statements
(:mod:`jobplane.store.postgres`) write the same effects by hand; ``tests/test_transitions.py``
runs them and checks them against the table.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from sqlalchemy import ClauseElement, ColumnElement, case, insert, update

from jobplane.domain.models import Instance, Outcome
from jobplane.domain.states import InstanceState
from jobplane.domain.transitions import SlotChange, effects_of
from jobplane.store import rows
from jobplane.store.base import unindexed_state
from jobplane.store.engine import AsyncConnection
from jobplane.store.tables import instance_transitions, job_instances, job_slots, runaway_slots

columns = job_instances.c


@dataclass(frozen=True, slots=True)
class NewAttempt:
    """What entering Processing writes besides the table's effects: the claimer, a fresh claim
    token per instance, and the lease."""

    worker_id: str
    tokens: Mapping[UUID, int]
    started_at: datetime
    lease_expires_at: datetime


async def move_instances(
    conn: AsyncConnection,
    now: ColumnElement[datetime],
    ids: Sequence[UUID],
    from_state: InstanceState,
    to_state: InstanceState,
    *,
    actor: str | None,
    reason: str | None,
    claim_token: int | Mapping[UUID, int] | None = None,
    values: Mapping[str, Any] | None = None,
    attempt: NewAttempt | None = None,
    cancel_reason: str | None = None,
    holds_slot: bool = False,
) -> list[Instance]:
    """Move those of ``ids`` still in ``from_state`` (and, when given, still holding
    ``claim_token``) to ``to_state``, in ``conn``'s transaction; returns the moved instances in
    the order of ``ids``. Rows that no longer match are left alone and get no history.
    ``claim_token`` may be given per instance (a mapping by id): each row is fenced by its own.
    ``now`` is the database's clock as an SQL expression (the store's ``_clock()``).

    ``actor`` is recorded in the history (``None``: the attempt's worker). ``values`` are
    further columns of this move (a result, a retry's ``run_at``, the publication of a run now);
    ``attempt`` is required when
    entering Processing. ``cancel_reason``: a row with ``cancel_requested`` ends Cancelled
    instead, with that reason. ``holds_slot``: leaving Processing, the slot is not given back
    but recorded in ``runaway_slots`` as held by the attempt's still-running code.

    Several rows are moved by one UPDATE, which on Postgres locks them in the order its plan
    meets them. Callers therefore either lock the batch first in id order (``FOR UPDATE``), or
    select it with ``SKIP LOCKED`` (the sweeps: due promotions in ``run_at`` order, expired
    leases in expiry order, orphaned pins), so that two writers never wait on each other's
    rows in opposite orders; a single row needs neither."""
    if not ids:
        return []
    effects = effects_of(from_state, to_state)
    if effects.starts_attempt != (attempt is not None):
        raise ValueError(f"{from_state} → {to_state}: a new attempt is needed exactly here")
    if holds_slot and effects.slot is not SlotChange.RETURN:
        raise ValueError(f"{from_state} → {to_state} holds no slot to keep")
    changes = _changes(from_state, to_state, reason, now, attempt)
    if cancel_reason is not None:
        # A cancel beats a retry, decided by this UPDATE on the row it locks (Postgres
        # re-reads a row it waited for; SQLite: BEGIN IMMEDIATE): a cancel request committed
        # before it is seen here; one committed after finds the instance Scheduled/Enqueued
        # (retry) or Terminated and acts on that state.
        changes = _either(
            columns.cancel_requested.is_(True),
            _changes(from_state, InstanceState.CANCELLED, cancel_reason, now, None),
            changes,
        )
    extra = dict(values or {})
    # Run now (Scheduled → Enqueued) may record the publication in its move: its caller sends
    # the message at once, and clears the mark if the send fails. No other move may.
    run_now = (from_state, to_state) == (InstanceState.SCHEDULED, InstanceState.ENQUEUED)
    mine = changes.keys() - ({"published_at"} if run_now else set())
    if clash := extra.keys() & mine:
        raise ValueError(f"columns {sorted(clash)} are the transition's own")
    changes = {k: v for k, v in changes.items() if k not in extra}
    where = [columns.id.in_(list(ids)), unindexed_state(columns, from_state)]
    if isinstance(claim_token, Mapping):
        # Fencing, row by row: each attempt's outcome matches its own row only while the row
        # still holds that attempt's token.
        where.append(columns.claim_token == case(dict(claim_token), value=columns.id))
    elif claim_token is not None:
        # Fencing: a stale attempt (lease lost, instance re-claimed) matches nothing.
        where.append(columns.claim_token == claim_token)
    result = await conn.execute(
        update(job_instances).where(*where).values(**changes, **extra).returning(*job_instances.c)
    )
    by_id = {r.id: rows.instance_from_row(r._mapping) for r in result}
    moved = [by_id[i] for i in dict.fromkeys(ids) if i in by_id]
    await _count_slots(conn, from_state, moved, now, holds_slot)
    await _record(conn, from_state, moved, actor)
    return moved


def _changes(
    from_state: InstanceState,
    to_state: InstanceState,
    reason: str | None,
    now: ColumnElement[datetime],
    attempt: NewAttempt | None,
) -> dict[str, Any]:
    """The columns ``from_state → to_state`` writes, from the table."""
    effects = effects_of(from_state, to_state)
    out: dict[str, Any] = {"state": to_state.value, "reason": reason}
    if effects.sets_finished_at:
        out["finished_at"] = now
    if effects.clears_published_at:
        out["published_at"] = None  # to be published again by the caller or the sweep
    if effects.clears_lease:
        out["lease_expires_at"] = None
    if effects.starts_attempt:
        assert attempt is not None
        out |= {
            "claim_token": case(dict(attempt.tokens), value=columns.id),
            "worker_id": attempt.worker_id,
            "lease_expires_at": attempt.lease_expires_at,
            "started_at": attempt.started_at,
            "attempt": columns.attempt + 1,
            "progress": None,
            "progress_message": None,
        }
    return out


def _either(
    wanted: ColumnElement[bool], then: dict[str, Any], otherwise: dict[str, Any]
) -> dict[str, Any]:
    """Columns that take ``then`` where ``wanted`` holds and ``otherwise`` elsewhere (a column
    only one side writes keeps its value on the other)."""
    out: dict[str, Any] = {}
    for name in then.keys() | otherwise.keys():
        keep = columns[name]
        a, b = then.get(name, keep), otherwise.get(name, keep)
        plain = not isinstance(a, ClauseElement) and not isinstance(b, ClauseElement)
        out[name] = a if a is b or (plain and a == b) else case((wanted, a), else_=b)
    return out


async def _count_slots(
    conn: AsyncConnection,
    from_state: InstanceState,
    moved: Sequence[Instance],
    now: ColumnElement[datetime],
    holds_slot: bool,
) -> None:
    """Take or give back each moved instance's slot (job keys in order, as claims lock them:
    no deadlock), or record it as held by the attempt's runaway code."""
    per_key: dict[str, int] = {}
    for instance in moved:
        change = effects_of(from_state, instance.state).slot
        if change is SlotChange.RETURN and holds_slot:
            continue
        if change is not SlotChange.NONE:
            per_key[instance.job_key] = per_key.get(instance.job_key, 0) + change.value
    for key, n in sorted(per_key.items()):
        await conn.execute(
            update(job_slots).where(job_slots.c.job_key == key).values(used=job_slots.c.used + n)
        )
    for instance in moved if holds_slot else ():
        # The outcome is recorded but the code still runs: the slot stays taken, on record as
        # this attempt's until its worker (or the dead-worker sweep) releases it.
        await conn.execute(
            insert(runaway_slots).values(
                instance_id=instance.id,
                claim_token=instance.claim_token,
                job_key=instance.job_key,
                worker_id=instance.worker_id,
                held_since=now,
            )
        )


async def _record(
    conn: AsyncConnection, from_state: InstanceState, moved: Sequence[Instance], actor: str | None
) -> None:
    """The history records of ``moved`` (``at``: the database's clock, its server default)."""
    if not moved:
        return
    await conn.execute(
        instance_transitions.insert(),
        [
            {
                "instance_id": i.id,
                "from_state": from_state.value,
                "to_state": i.state.value,
                "actor": actor or i.worker_id or "system",
                "reason": i.reason,
                "claim_token": (
                    i.claim_token if effects_of(from_state, i.state).records_claim_token else None
                ),
            }
            for i in moved
        ],
    )


# Two writes to Enqueued instances that are not moves (the state stays, so no history record
# and no slot change), kept here beside the moves so that every write of the publication
# bookkeeping outside a move is in one place. The Postgres claim statement parks its own.


async def park(conn: AsyncConnection, ids: Sequence[UUID]) -> None:
    """Park Enqueued instances whose job is at its limit (``on_limit="wait"``): their
    publication mark is cleared, so whoever frees a slot republishes them (and the sweep
    finds them unpublished)."""
    if ids:
        await conn.execute(
            update(job_instances)
            .where(columns.id.in_(list(ids)), unindexed_state(columns, InstanceState.ENQUEUED))
            .values(published_at=None)
        )


async def unpin(conn: AsyncConnection, ids: Sequence[UUID], reason: str) -> list[Instance]:
    """Give Enqueued instances pinned to a worker gone for good to their queue: no pin, no
    publication mark (their message must go to the queue's stream now), ``reason`` says why."""
    if not ids:
        return []
    result = await conn.execute(
        update(job_instances)
        .where(columns.id.in_(list(ids)), unindexed_state(columns, InstanceState.ENQUEUED))
        .values(pinned_worker=None, published_at=None, reason=reason)
        .returning(*job_instances.c)
    )
    return [rows.instance_from_row(r._mapping) for r in result]


#: Outcomes recorded by one move at most (its statement names each instance three times).
ALIKE_MOST = 1000


def alike_outcomes(outcomes: Sequence[Outcome]) -> list[list[Outcome]]:
    """``outcomes`` in groups that write the same (state, reason, result, error, slot kept),
    each of at most :data:`ALIKE_MOST`. An instance met again starts a new run of groups after
    the ones before, so each instance's outcomes are recorded in their order, as one by one
    (the later ones find it moved: fenced)."""
    runs: list[list[Outcome]] = [[]]
    seen: set[UUID] = set()
    for outcome in outcomes:
        if outcome.instance_id in seen:
            runs.append([])
            seen = set()
        seen.add(outcome.instance_id)
        runs[-1].append(outcome)
    out: list[list[Outcome]] = []
    for run in runs:
        groups: dict[tuple[Any, ...], list[Outcome]] = {}
        for outcome in run:
            error = outcome.error.to_json() if outcome.error else None
            key = (
                outcome.state,
                outcome.reason,
                json.dumps(outcome.result),
                json.dumps(error),
                outcome.holds_slot,
            )
            groups.setdefault(key, []).append(outcome)
        for group in groups.values():
            out.extend(group[i : i + ALIKE_MOST] for i in range(0, len(group), ALIKE_MOST))
    return out


__all__ = ["ALIKE_MOST", "NewAttempt", "alike_outcomes", "move_instances", "park", "unpin"]
