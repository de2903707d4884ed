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
    delete,
    or_,
    select,
    tuple_,
    update,
)

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
)
from jobplane.store import rows
from jobplane.store.base import (
    SqlBase,
    locked_in_id_order,
    logger,
    retry_conflicts,
    unindexed_state,
)
from jobplane.store.engine import AsyncConnection
from jobplane.store.moves import NewAttempt, alike_outcomes, move_instances, park
from jobplane.store.tables import (
    job_definitions,
    job_instances,
    job_slots,
    runaway_slots,
)

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
            found = await self._lock_claimable(conn, ids, worker_id, jobs)
            # A cancel that reached a running attempt which was then released (shutdown) left
            # the flag on an Enqueued row: that row is never run again. It is read from the
            # row locked above, so a cancel request cannot slip in before the claim.
            cancel_ids = [c.id for c in found if c.cancel_requested]
            candidates = [c for c in found if not c.cancel_requested]
            await move_instances(
                conn,
                self._clock(),
                cancel_ids,
                InstanceState.ENQUEUED,
                InstanceState.CANCELLED,
                actor=worker_id,
                reason=EndReason.CANCEL_BEFORE_CLAIM,
            )
            slots = await self._lock_slots(conn, {c.job_key for c in candidates})
            claim_ids, skip_ids, wait_ids = _allot(candidates, slots)
            claimed = await self._take(conn, claim_ids, worker_id, now, lease_s)
            await self._end_excess(conn, skip_ids, worker_id)
            await park(conn, wait_ids)
        options = {key: opts for key, (_, opts) in slots.items()}
        handled = {*claim_ids, *skip_ids, *wait_ids, *cancel_ids}
        return ClaimResult(
            claimed=[Claim(instance=i, options=options[i.job_key]) for i in claimed],
            skipped=skip_ids,
            waiting=wait_ids,
            cancelled=cancel_ids,
            ignored=[i for i in dict.fromkeys(ids) if i not in handled],
        )

    async def _lock_claimable(
        self, conn: AsyncConnection, ids: Sequence[UUID], worker_id: str, jobs: Collection[str]
    ) -> Sequence[Row[Any, Any, Any, Any]]:
        """Lock, in id order, those of ``ids`` this worker may claim: Enqueued, of a job it
        runs, not pinned to another worker."""
        result = await conn.execute(
            select(
                job_instances.c.id,
                job_instances.c.job_key,
                job_instances.c.priority,
                job_instances.c.cancel_requested,
            )
            .where(
                job_instances.c.id.in_(list(ids)),
                unindexed_state(job_instances.c, InstanceState.ENQUEUED),
                job_instances.c.job_key.in_(list(jobs)),
                or_(
                    job_instances.c.pinned_worker.is_(None),
                    job_instances.c.pinned_worker == worker_id,
                ),
            )
            .order_by(job_instances.c.id)
            .with_for_update()
        )
        return result.all()

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
        """Enqueued → Processing for ``ids`` (their slots are locked and free), each with a
        fresh claim token."""
        if not ids:
            return []
        tokens = await self._next_tokens(conn, len(ids))
        attempt = NewAttempt(
            worker_id=worker_id,
            tokens=dict(zip(ids, tokens, strict=True)),
            started_at=now,
            lease_expires_at=now + timedelta(seconds=lease_s),
        )
        return await move_instances(
            conn,
            self._clock(),
            ids,
            InstanceState.ENQUEUED,
            InstanceState.PROCESSING,
            actor=worker_id,
            reason=None,
            attempt=attempt,
        )

    async def _end_excess(self, conn: AsyncConnection, ids: list[UUID], actor: str) -> None:
        """Enqueued → Skipped for the instances over the limit of an ``on_limit=skip`` job."""
        await move_instances(
            conn,
            self._clock(),
            ids,
            InstanceState.ENQUEUED,
            InstanceState.SKIPPED,
            actor=actor,
            reason=EndReason.LIMIT_REACHED,
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
        tokens = dict(leases)
        async with self._write() as conn:
            kept = await self._renew(conn, list(leases), lease_s)
            for instance_id, (fraction, message) in progress.items():
                if instance_id in kept:  # the lease (and so the token) was just checked
                    await conn.execute(
                        update(job_instances)
                        .where(
                            job_instances.c.id == instance_id,
                            job_instances.c.claim_token == tokens[instance_id],
                            unindexed_state(job_instances.c, InstanceState.PROCESSING),
                        )
                        .values(progress=fraction, progress_message=message)
                    )
            return kept

    async def _renew(
        self, conn: AsyncConnection, leases: list[tuple[UUID, int]], lease_s: float
    ) -> dict[UUID, bool]:
        """Extend the leases still held (the instance Processing under that claim token) to
        ``lease_s`` from the transaction's time: ``{id: cancel_requested}`` of those renewed."""
        now = await self._now(conn)
        fenced = and_(
            tuple_(job_instances.c.id, job_instances.c.claim_token).in_(leases),
            unindexed_state(job_instances.c, InstanceState.PROCESSING),
        )
        # Locked in id order, as the outcome statement locks them: a heartbeat and the
        # recording of outcomes of the same attempts never deadlock.
        result = await conn.execute(
            update(job_instances)
            .where(
                fenced,
                locked_in_id_order(
                    lambda c: (
                        tuple_(c.id, c.claim_token).in_(leases)
                        & unindexed_state(c, InstanceState.PROCESSING)
                    )
                ),
            )
            .values(lease_expires_at=now + timedelta(seconds=lease_s))
            .returning(job_instances.c.id, job_instances.c.cancel_requested)
        )
        return {r.id: r.cancel_requested for r in result}

    @retry_conflicts
    async def save_checkpoint(self, instance_id: UUID, claim_token: int, data: Any) -> bool:
        async with self._write() as conn:
            result = await conn.execute(
                update(job_instances)
                .where(
                    job_instances.c.id == instance_id,
                    job_instances.c.claim_token
                    == claim_token,  # fencing: a stale attempt saves nothing
                    job_instances.c.state == InstanceState.PROCESSING.value,
                )
                .values(checkpoint=data)
                .returning(job_instances.c.id)
            )
            return result.first() is not None

    @retry_conflicts
    async def complete(self, outcomes: Sequence[Outcome]) -> dict[UUID, InstanceState]:
        if not outcomes:
            return {}
        for outcome in outcomes:
            check_transition(InstanceState.PROCESSING, outcome.state)
        async with self._write() as conn:
            ended: dict[UUID, InstanceState] = {}
            # Outcomes alike but for their instance (a worker's batch of no-op successes) are
            # recorded by one move: three statements for the batch, not for each outcome.
            for alike in alike_outcomes(outcomes):
                first = alike[0]
                moved = await move_instances(
                    conn,
                    self._clock(),
                    [o.instance_id for o in alike],
                    InstanceState.PROCESSING,
                    first.state,
                    claim_token={o.instance_id: o.claim_token for o in alike},
                    actor=None,
                    reason=first.reason,
                    values={
                        "result": first.result,
                        "error": first.error.to_json() if first.error else None,
                    },
                    # A cancel beats a retry (see move_instances): the row locked by the
                    # UPDATE decides, so no cancel request slips in between.
                    cancel_reason=(
                        EndReason.CANCEL_WINS if first.state is InstanceState.FAILED else None
                    ),
                    holds_slot=first.holds_slot,
                )
                recorded = {m.id: m.state for m in moved}
                ended.update(recorded)
                for outcome in alike:
                    if outcome.instance_id not in recorded:
                        log_fenced(outcome)
            failed = [o for o in outcomes if ended.get(o.instance_id) is InstanceState.FAILED]
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
                    select(
                        job_instances.c.retries_used,
                        job_instances.c.worker_id,
                        job_definitions.c.options,
                    )
                    .join(job_definitions, job_definitions.c.key == job_instances.c.job_key)
                    .where(job_instances.c.id == outcome.instance_id)
                )
            ).one()
            options = JobOptions.from_stored(row.options)
            retries = options.retries
            values: dict[str, Any] = {}
            if row.retries_used < retries:
                now = await self._now(conn)
                delay = max(outcome.retry_delay_s, 0.0)
                target = InstanceState.SCHEDULED if delay > 0 else InstanceState.ENQUEUED
                values = {
                    "retries_used": job_instances.c.retries_used + 1,
                    "run_at": now + timedelta(seconds=delay),
                }
                if options.retry_on_same_worker:
                    values["pinned_worker"] = row.worker_id
                reason = f"retry {row.retries_used + 1} of {retries}"
            else:
                target, reason = InstanceState.TERMINATED, EndReason.NO_ATTEMPTS_LEFT
            moved = await move_instances(
                conn,
                self._clock(),
                [outcome.instance_id],
                InstanceState.FAILED,
                target,
                claim_token=outcome.claim_token,
                actor=None,
                reason=reason,
                values=values,
            )
            for instance in moved:
                out[instance.id] = instance.state
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
            if to_state is InstanceState.PROCESSING:
                # Entering Processing is a claim (a new attempt, a token, a lease): never this.
                raise IllegalTransitionError(state, to_state)
        async with self._write() as conn:
            # The row is locked: the state read here is the one the UPDATE compares with.
            current = await conn.scalar(
                select(job_instances.c.state)
                .where(job_instances.c.id == instance_id)
                .with_for_update()
            )
            if current is None or InstanceState(current) not in expect:
                return None
            moved = await move_instances(
                conn,
                self._clock(),
                [instance_id],
                InstanceState(current),
                to_state,
                claim_token=claim_token,
                actor=actor,
                reason=reason,
            )
            return moved[0] if moved else None

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
    async def republish_waiting(self, job_keys: Collection[str], limit: int) -> list[Instance]:
        if not job_keys or limit <= 0:
            return []
        async with self._write() as conn:
            picked = (
                select(job_instances.c.id)
                .where(
                    job_instances.c.job_key.in_(list(job_keys)),
                    job_instances.c.state == InstanceState.ENQUEUED.value,
                    job_instances.c.published_at.is_(None),
                )
                .order_by(job_instances.c.priority.desc(), job_instances.c.id)
                .limit(limit)
                .with_for_update(skip_locked=True)
            )
            ids = list((await conn.execute(picked)).scalars())
            if not ids:
                return []
            result = await conn.execute(
                update(job_instances)
                .where(
                    job_instances.c.id.in_(ids),
                    unindexed_state(job_instances.c, InstanceState.ENQUEUED),
                )
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
