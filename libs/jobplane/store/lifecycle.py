"""The attempt lifecycle: claim, heartbeat, complete, transitions, cancel.

Every state change is a compare-and-set on the current state (and, for an attempt's writes,
the claim token) with its history record in the same transaction; leaving Processing gives
the job's concurrency slot back in the same transaction.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from sqlalchemy import (
    ColumnElement,
    Row,
    and_,
    case,
    delete,
    insert,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.ext.asyncio import AsyncConnection

from jobplane.domain.models import (
    Claim,
    ClaimResult,
    Instance,
    Outcome,
)
from jobplane.domain.options import JobOptions, OnLimit
from jobplane.domain.reasons import EndReason
from jobplane.domain.states import InstanceState, check_transition
from jobplane.errors import (
    IllegalTransitionError,
    InstanceNotFoundError,
)
from jobplane.store import rows
from jobplane.store.base import I, S, SqlBase, locked_in_id_order, logger, retry_conflicts
from jobplane.store.tables import (
    job_definitions,
    job_instances,
    job_slots,
    runaway_slots,
)

LIMIT_REASON = "max concurrency reached"
#: A failed attempt (exception or timeout) of an instance whose cancel was requested.
CANCEL_WINS_REASON = "cancel requested; the failed attempt is not retried"
#: An Enqueued instance found with ``cancel_requested`` by a claim.
CANCEL_BEFORE_CLAIM_REASON = "cancel requested; not run again"

#: (fraction done in [0, 1], message) reported by a running job.
Progress = tuple[float, str | None]


class LifecycleStore(SqlBase):
    """Claims and transitions (generic; Postgres overrides the hot paths)."""

    @retry_conflicts
    async def claim(
        self, ids: Sequence[UUID], worker_id: str, lease_s: float, jobs: Collection[str]
    ) -> ClaimResult:
        if not ids:
            return ClaimResult()
        async with self._write() as conn:
            now = await self._now(conn)
            found = (
                await conn.execute(
                    select(I.id, I.job_key, I.priority, I.cancel_requested)
                    .where(
                        I.id.in_(list(ids)),
                        I.state == S.ENQUEUED.value,
                        I.job_key.in_(list(jobs)),
                        or_(I.pinned_worker.is_(None), I.pinned_worker == worker_id),
                    )
                    .order_by(I.id)
                    .with_for_update()
                )
            ).all()
            # A cancel that reached a running attempt which was then released (shutdown) left
            # the flag on an Enqueued row: that row is never run again. It is read from the
            # row locked above, so a cancel request cannot slip in before the claim.
            cancel_ids = [c.id for c in found if c.cancel_requested]
            candidates = [c for c in found if not c.cancel_requested]
            for instance_id in cancel_ids:
                await self._move(
                    conn,
                    instance_id,
                    S.CANCELLED,
                    expect=(S.ENQUEUED,),
                    claim_token=None,
                    actor=worker_id,
                    reason=CANCEL_BEFORE_CLAIM_REASON,
                )
            slots = await self._lock_slots(conn, {c.job_key for c in candidates})
            claim_ids, skip_ids, wait_ids = _allot(candidates, slots)
            claimed = await self._take(conn, claim_ids, worker_id, now, lease_s)
            await self._end_excess(conn, skip_ids, worker_id)
            if wait_ids:
                # Parked until a slot frees: unpublished, so the releaser republishes it.
                await conn.execute(
                    update(job_instances)
                    .where(I.id.in_(wait_ids), I.state == S.ENQUEUED.value)
                    .values(published_at=None)
                )
        options = {key: opts for key, (_, opts) in slots.items()}
        handled = {*claim_ids, *skip_ids, *wait_ids, *cancel_ids}
        return ClaimResult(
            claimed=[Claim(instance=i, options=options[i.job_key]) for i in claimed],
            skipped=skip_ids,
            waiting=wait_ids,
            cancelled=cancel_ids,
            ignored=[i for i in dict.fromkeys(ids) if i not in handled],
        )

    async def _lock_slots(
        self, conn: AsyncConnection, keys: set[str]
    ) -> dict[str, tuple[int, JobOptions]]:
        """Lock the slot rows of ``keys`` (in key order: no deadlock between claimers) and
        return each key's free slots and current options."""
        if not keys:
            return {}
        result = await conn.execute(
            select(job_slots.c.job_key, job_slots.c.used, job_definitions.c.options)
            .join(job_definitions, job_definitions.c.key == job_slots.c.job_key)
            .where(job_slots.c.job_key.in_(keys))
            .order_by(job_slots.c.job_key)
            .with_for_update(of=job_slots)
        )
        out: dict[str, tuple[int, JobOptions]] = {}
        for key, used, raw in result:
            options = JobOptions.from_stored(raw)
            out[key] = (options.max_concurrency - used, options)
        return out

    async def _take(
        self,
        conn: AsyncConnection,
        ids: list[UUID],
        worker_id: str,
        now: datetime,
        lease_s: float,
    ) -> list[Instance]:
        if not ids:
            return []
        tokens = await self._next_tokens(conn, len(ids))
        claimed: list[Instance] = []
        for instance_id, token in zip(ids, tokens, strict=True):
            row = (
                await conn.execute(
                    update(job_instances)
                    .where(I.id == instance_id, I.state == S.ENQUEUED.value)
                    .values(
                        state=S.PROCESSING.value,
                        claim_token=token,
                        worker_id=worker_id,
                        lease_expires_at=now + timedelta(seconds=lease_s),
                        started_at=now,
                        attempt=I.attempt + 1,
                        progress=None,
                        progress_message=None,
                        reason=None,
                    )
                    .returning(*job_instances.c)
                )
            ).one()
            claimed.append(rows.instance_from_row(row._mapping))
        per_key: dict[str, int] = {}
        for instance in claimed:
            per_key[instance.job_key] = per_key.get(instance.job_key, 0) + 1
        for key, n in per_key.items():
            await conn.execute(
                update(job_slots)
                .where(job_slots.c.job_key == key)
                .values(used=job_slots.c.used + n)
            )
        await self._history(
            conn,
            [
                {
                    "instance_id": i.id,
                    "from_state": S.ENQUEUED.value,
                    "to_state": S.PROCESSING.value,
                    "actor": worker_id,
                    "claim_token": i.claim_token,
                }
                for i in claimed
            ],
        )
        return claimed

    async def _end_excess(self, conn: AsyncConnection, ids: list[UUID], actor: str) -> None:
        if not ids:
            return
        await conn.execute(
            update(job_instances)
            .where(I.id.in_(ids), I.state == S.ENQUEUED.value)
            .values(state=S.SKIPPED.value, finished_at=self._clock(), reason=LIMIT_REASON)
        )
        await self._history(
            conn,
            [
                {
                    "instance_id": i,
                    "from_state": S.ENQUEUED.value,
                    "to_state": S.SKIPPED.value,
                    "actor": actor,
                    "reason": LIMIT_REASON,
                }
                for i in ids
            ],
        )

    @retry_conflicts
    async def heartbeat(
        self,
        leases: Collection[tuple[UUID, int]],
        lease_s: float,
        progress: Mapping[UUID, Progress] | None = None,
    ) -> dict[UUID, bool]:
        if not leases:
            return {}
        progress = progress or {}
        async with self._write() as conn:
            now = await self._now(conn)
            fenced = and_(
                tuple_(I.id, I.claim_token).in_(list(leases)), I.state == S.PROCESSING.value
            )
            # Locked in id order, as the outcome statement locks them: a heartbeat and the
            # recording of outcomes of the same attempts never deadlock.
            pairs = list(leases)
            result = await conn.execute(
                update(job_instances)
                .where(
                    fenced,
                    locked_in_id_order(
                        lambda c: (
                            tuple_(c.id, c.claim_token).in_(pairs) & (c.state == S.PROCESSING.value)
                        )
                    ),
                )
                .values(lease_expires_at=now + timedelta(seconds=lease_s))
                .returning(I.id, I.cancel_requested)
            )
            kept = {r.id: r.cancel_requested for r in result}
            for instance_id, (fraction, message) in progress.items():
                if instance_id in kept:  # the lease (and so the token) was just checked
                    await conn.execute(
                        update(job_instances)
                        .where(I.id == instance_id, fenced)
                        .values(progress=fraction, progress_message=message)
                    )
            return kept

    @retry_conflicts
    async def save_checkpoint(self, instance_id: UUID, claim_token: int, data: Any) -> bool:
        async with self._write() as conn:
            result = await conn.execute(
                update(job_instances)
                .where(
                    I.id == instance_id,
                    I.claim_token == claim_token,  # fencing: a stale attempt saves nothing
                    I.state == S.PROCESSING.value,
                )
                .values(checkpoint=data)
                .returning(I.id)
            )
            return result.first() is not None

    @retry_conflicts
    async def complete(self, outcomes: Sequence[Outcome]) -> dict[UUID, InstanceState]:
        if not outcomes:
            return {}
        async with self._write() as conn:
            ended: dict[UUID, InstanceState] = {}
            for outcome in outcomes:
                check_transition(S.PROCESSING, outcome.state)
                moved = await self._move(
                    conn,
                    outcome.instance_id,
                    outcome.state,
                    expect=(S.PROCESSING,),
                    claim_token=outcome.claim_token,
                    actor=None,
                    reason=outcome.reason,
                    values={
                        "result": outcome.result,
                        "error": outcome.error.to_json() if outcome.error else None,
                    },
                    cancel_wins=outcome.state is S.FAILED,
                    hold_slot=outcome.holds_slot,
                )
                if moved is None:
                    log_fenced(outcome)
                    continue
                ended[moved.id] = moved.state
            failed = [o for o in outcomes if ended.get(o.instance_id) is S.FAILED]
            ended.update(await self._after_failure(conn, failed))
        return ended

    async def _after_failure(
        self, conn: AsyncConnection, failed: Sequence[Outcome]
    ) -> dict[UUID, InstanceState]:
        """Failed → Scheduled/Enqueued (a retry, attempts left) or → Terminated."""
        out: dict[UUID, InstanceState] = {}
        for outcome in failed:
            row = (
                await conn.execute(
                    select(I.retries_used, I.worker_id, job_definitions.c.options)
                    .join(job_definitions, job_definitions.c.key == I.job_key)
                    .where(I.id == outcome.instance_id)
                )
            ).one()
            options = JobOptions.from_stored(row.options)
            retries = options.retries
            values: dict[str, Any] = {}
            if row.retries_used < retries:
                now = await self._now(conn)
                delay = max(outcome.retry_delay_s, 0.0)
                target = S.SCHEDULED if delay > 0 else S.ENQUEUED
                values = {
                    "retries_used": I.retries_used + 1,
                    "run_at": now + timedelta(seconds=delay),
                    "finished_at": None,
                }
                if options.retry_on_same_worker:
                    values["pinned_worker"] = row.worker_id
                reason = f"retry {row.retries_used + 1} of {retries}"
            else:
                target, reason = S.TERMINATED, "no attempts left"
            moved = await self._move(
                conn,
                outcome.instance_id,
                target,
                expect=(S.FAILED,),
                claim_token=outcome.claim_token,
                actor=None,
                reason=reason,
                values=values,
            )
            if moved is not None:
                out[moved.id] = moved.state
        return out

    @retry_conflicts
    async def transition(
        self,
        instance_id: UUID,
        to_state: InstanceState,
        *,
        expect: Collection[InstanceState],
        claim_token: int | None = None,
        actor: str,
        reason: str | None = None,
    ) -> Instance | None:
        for state in expect:
            check_transition(state, to_state)
        async with self._write() as conn:
            return await self._move(
                conn,
                instance_id,
                to_state,
                expect=expect,
                claim_token=claim_token,
                actor=actor,
                reason=reason,
            )

    async def _move(
        self,
        conn: AsyncConnection,
        instance_id: UUID,
        to_state: InstanceState,
        *,
        expect: Collection[InstanceState],
        claim_token: int | None,
        actor: str | None,
        reason: str | None,
        values: dict[str, Any] | None = None,
        cancel_wins: bool = False,
        hold_slot: bool = False,
    ) -> Instance | None:
        """One compare-and-set transition with its history and slot release, inside ``conn``'s
        transaction. ``actor=None`` means the worker holding the claim. With ``cancel_wins``
        a row with ``cancel_requested`` ends Cancelled instead of ``to_state``. ``hold_slot``:
        leaving Processing keeps the slot, held by the attempt's runaway code (see
        :meth:`release_runaway_slot`)."""
        where = [I.id == instance_id, I.state.in_([s.value for s in expect])]
        if claim_token is not None:
            # Fencing: a stale attempt (lease lost, instance re-claimed) matches nothing.
            where.append(I.claim_token == claim_token)
        old = (
            await conn.execute(
                select(I.state, I.job_key, I.worker_id).where(*where).with_for_update()
            )
        ).first()
        if old is None:
            return None
        changes: dict[str, Any] = {"state": to_state.value, "reason": reason, **(values or {})}
        if to_state.is_terminal:
            changes["finished_at"] = self._clock()
        if old.state == S.PROCESSING.value:
            changes["lease_expires_at"] = None
        if to_state is S.ENQUEUED:
            changes["published_at"] = None  # to be published again by the caller or the sweep
        if cancel_wins:
            # A cancel beats a retry, decided by this UPDATE on the row locked above (FOR
            # UPDATE; SQLite: BEGIN IMMEDIATE): a cancel request committed before it is seen
            # here; one committed after finds the instance Scheduled/Enqueued (retry) or
            # Terminated and acts on that state.
            wanted = I.cancel_requested.is_(True)
            changes["state"] = case((wanted, S.CANCELLED.value), else_=to_state.value)
            changes["reason"] = case((wanted, CANCEL_WINS_REASON), else_=reason)
            changes["finished_at"] = case((wanted, self._clock()), else_=changes.get("finished_at"))
        row = (
            await conn.execute(
                update(job_instances)
                .where(I.id == instance_id, I.state == old.state, *where[2:])
                .values(**changes)
                .returning(*job_instances.c)
            )
        ).one()
        instance = rows.instance_from_row(row._mapping)
        if old.state == S.PROCESSING.value and hold_slot:
            # The outcome is recorded but the code still runs: the slot stays taken, on record
            # as this attempt's until its worker (or the dead-worker sweep) releases it.
            await conn.execute(
                insert(runaway_slots).values(
                    instance_id=instance_id,
                    claim_token=instance.claim_token,
                    job_key=old.job_key,
                    worker_id=old.worker_id,
                    held_since=self._clock(),
                )
            )
        elif old.state == S.PROCESSING.value:
            # Leaving Processing gives the slot back in the same transaction.
            await conn.execute(
                update(job_slots)
                .where(job_slots.c.job_key == old.job_key)
                .values(used=job_slots.c.used - 1)
            )
        await self._history(
            conn,
            [
                {
                    "instance_id": instance_id,
                    "from_state": old.state,
                    "to_state": instance.state.value,
                    "actor": actor or old.worker_id or "system",
                    "reason": instance.reason,
                    "claim_token": instance.claim_token,
                }
            ],
        )
        return instance

    @retry_conflicts
    async def release_runaway_slot(self, instance_id: UUID, claim_token: int) -> bool:
        async with self._write() as conn:
            released = await release_runaway_rows(
                conn,
                and_(
                    runaway_slots.c.instance_id == instance_id,
                    runaway_slots.c.claim_token == claim_token,
                ),
            )
        return bool(released)

    @retry_conflicts
    async def request_cancel(self, instance_id: UUID, actor: str) -> Instance:
        async with self._write() as conn:
            row = (
                await conn.execute(select(I.state).where(I.id == instance_id).with_for_update())
            ).first()
            if row is None:
                raise InstanceNotFoundError(instance_id)
            state = S(row.state)
            if state in (S.SCHEDULED, S.ENQUEUED):
                moved = await self._move(
                    conn,
                    instance_id,
                    S.CANCELLED,
                    expect=(state,),
                    claim_token=None,
                    actor=actor,
                    reason=EndReason.CANCELLED_BEFORE_RUN,
                )
                assert moved is not None  # the row is locked in this transaction
                return moved
            if state in (S.PROCESSING, S.FAILED):
                # The worker sees it on its next heartbeat (the bus only makes it faster).
                updated = (
                    await conn.execute(
                        update(job_instances)
                        .where(I.id == instance_id, I.state == state.value)
                        .values(cancel_requested=True)
                        .returning(*job_instances.c)
                    )
                ).one()
                return rows.instance_from_row(updated._mapping)
            raise IllegalTransitionError(state, S.CANCELLED)

    @retry_conflicts
    async def run_now(self, instance_id: UUID, actor: str) -> Instance:
        async with self._write() as conn:
            # Compare-and-set on Scheduled: a run racing the due-time sweep (or a cancel, or a
            # second run) moves the instance once; the loser sees the state it found.
            moved = await self._move(
                conn,
                instance_id,
                S.ENQUEUED,
                expect=(S.SCHEDULED,),
                claim_token=None,
                actor=actor,
                reason="run by hand",
                values={"run_at": self._clock()},
            )
            if moved is not None:
                return moved
            row = (await conn.execute(select(I.state).where(I.id == instance_id))).first()
        if row is None:
            raise InstanceNotFoundError(instance_id)
        raise IllegalTransitionError(S(row.state), "run now (only Scheduled instances)")

    @retry_conflicts
    async def republish_waiting(self, job_keys: Collection[str], limit: int) -> list[Instance]:
        if not job_keys or limit <= 0:
            return []
        async with self._write() as conn:
            picked = (
                select(I.id)
                .where(
                    I.job_key.in_(list(job_keys)),
                    I.state == S.ENQUEUED.value,
                    I.published_at.is_(None),
                )
                .order_by(I.priority.desc(), I.id)
                .limit(limit)
                .with_for_update(skip_locked=True)
            )
            ids = list((await conn.execute(picked)).scalars())
            if not ids:
                return []
            result = await conn.execute(
                update(job_instances)
                .where(I.id.in_(ids), I.state == S.ENQUEUED.value)
                .values(published_at=self._clock())
                .returning(*job_instances.c)
            )
            return [rows.instance_from_row(r._mapping) for r in result]


def _allot(
    candidates: Sequence[Row[Any, Any, Any, Any]], slots: dict[str, tuple[int, JobOptions]]
) -> tuple[list[UUID], list[UUID], list[UUID]]:
    """Give each job key's free slots to its candidates by priority, then age (id)."""
    claim: list[UUID] = []
    skip: list[UUID] = []
    wait: list[UUID] = []
    ranked = sorted(candidates, key=lambda c: (c.job_key, -c.priority, c.id))
    taken: dict[str, int] = {}
    for c in ranked:
        free, options = slots[c.job_key]
        if taken.get(c.job_key, 0) < free:
            taken[c.job_key] = taken.get(c.job_key, 0) + 1
            claim.append(c.id)
        elif options.on_limit is OnLimit.SKIP:
            skip.append(c.id)
        else:
            wait.append(c.id)
    return claim, skip, wait


async def release_runaway_rows(conn: AsyncConnection, which: ColumnElement[bool]) -> dict[str, int]:
    """Give back the slots held by the runaway rows ``which`` selects, inside ``conn``'s
    transaction; returns the slots freed per job key. The DELETE is the compare-and-set: the
    worker whose thread returned and the dead-worker sweep may race for one row, and only the
    one whose DELETE removed it gives the slot back (the other waits on the row lock, then
    matches nothing), so a slot is never given back twice."""
    gone = (
        await conn.execute(delete(runaway_slots).where(which).returning(runaway_slots.c.job_key))
    ).scalars()
    per_key: dict[str, int] = {}
    for key in gone:
        per_key[key] = per_key.get(key, 0) + 1
    for key, n in sorted(per_key.items()):  # key order, as claims lock them: no deadlock
        await conn.execute(
            update(job_slots).where(job_slots.c.job_key == key).values(used=job_slots.c.used - n)
        )
    return per_key


def log_fenced(outcome: Outcome) -> None:
    """One line for an outcome refused because its attempt no longer holds the instance."""
    logger.warning(
        "outcome of instance %s refused: claim token %s no longer holds",
        outcome.instance_id,
        outcome.claim_token,
        extra={"action": "store.fenced", "instance_id": str(outcome.instance_id)},
    )
