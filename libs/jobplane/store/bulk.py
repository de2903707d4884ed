"""An operator's moves: cancel one instance or all a filter selects, run a held or delayed one
now.

One transaction per call. The selected rows are locked in id order (the order claimers lock
in, so the two cannot deadlock); each change is still a compare-and-set on the state just
read, with its history record written in the same transaction.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

from sqlalchemy import select, update

from jobplane.domain.models import BulkCancel, Instance, InstanceFilter
from jobplane.domain.reasons import EndReason
from jobplane.domain.states import QUEUED_STATES, RUNNING_STATES, InstanceState
from jobplane.errors import IllegalTransitionError, InstanceNotFoundError
from jobplane.store import rows
from jobplane.store.base import SqlBase, retry_conflicts, unindexed_state
from jobplane.store.engine import AsyncConnection
from jobplane.store.instances import filtered
from jobplane.store.moves import move_instances
from jobplane.store.tables import job_instances


class OperatorStore(SqlBase):
    """Cancels and runs asked for by an operator (API, CLI, client, dashboard)."""

    @retry_conflicts
    async def request_cancel(self, instance_id: UUID, actor: str) -> Instance:
        async with self._write() as conn:
            row = (
                await conn.execute(
                    select(job_instances.c.state)
                    .where(job_instances.c.id == instance_id)
                    .with_for_update()
                )
            ).first()
            if row is None:
                raise InstanceNotFoundError(instance_id)
            state = InstanceState(row.state)
            if state in QUEUED_STATES:
                [moved] = await move_instances(  # the row is locked in this transaction
                    conn,
                    self._clock(),
                    [instance_id],
                    state,
                    InstanceState.CANCELLED,
                    actor=actor,
                    reason=EndReason.CANCELLED_BEFORE_RUN,
                )
                return moved
            if state in RUNNING_STATES:
                # The worker sees it on its next heartbeat (the bus only makes it faster).
                updated = (
                    await conn.execute(
                        update(job_instances)
                        .where(
                            job_instances.c.id == instance_id, job_instances.c.state == state.value
                        )
                        .values(cancel_requested=True)
                        .returning(*job_instances.c)
                    )
                ).one()
                return rows.instance_from_row(updated._mapping)
            raise IllegalTransitionError(state, InstanceState.CANCELLED)

    @retry_conflicts
    async def run_now(self, instance_id: UUID, actor: str, *, published: bool = False) -> Instance:
        async with self._write() as conn:
            # (With ``published``, the publication is recorded by the move itself, as a
            # trigger's insert records it: one write, and the instance answered says it. The
            # clock is read once the write has its turn: SQLite's is the process's.)
            values: dict[str, Any] = {"run_at": self._clock()}
            if published:
                values["published_at"] = self._clock()
            # Compare-and-set on Scheduled: a run racing the due-time sweep (or a cancel, or a
            # second run) moves the instance once; the loser sees the state it found.
            moved = await move_instances(
                conn,
                self._clock(),
                [instance_id],
                InstanceState.SCHEDULED,
                InstanceState.ENQUEUED,
                actor=actor,
                reason=EndReason.RUN_BY_HAND,
                values=values,
            )
            if moved:
                return moved[0]
            row = (
                await conn.execute(
                    select(job_instances.c.state).where(job_instances.c.id == instance_id)
                )
            ).first()
        if row is None:
            raise InstanceNotFoundError(instance_id)
        raise IllegalTransitionError(InstanceState(row.state), "run now (only Scheduled instances)")

    @retry_conflicts
    async def cancel_many(self, filter: InstanceFilter, *, limit: int, actor: str) -> BulkCancel:
        selection = filter.for_cancel()
        if selection is None:
            return BulkCancel()
        selected = filtered(select(job_instances.c.id, job_instances.c.state), selection)
        async with self._write() as conn:
            # Lock what the filter selects, oldest first. A row that changed while we waited
            # for its lock is re-checked against the filter by Postgres (and SQLite writes are
            # serialised), so the states read here are the states the rows are in.
            found = (
                await conn.execute(
                    selected.order_by(job_instances.c.id).limit(limit + 1).with_for_update()
                )
            ).all()
            more = len(found) > limit
            by_state: dict[InstanceState, list[UUID]] = {}
            for instance_id, state in found[:limit]:
                by_state.setdefault(InstanceState(state), []).append(instance_id)
            cancelled: list[Instance] = []
            for state in QUEUED_STATES:
                cancelled += await self._cancel_queued(conn, by_state.get(state, []), state, actor)
            running = [i for state in RUNNING_STATES for i in by_state.get(state, [])]
            requested = await self._request_cancel(conn, running)
        done = {i.id for i in cancelled} | {i.id for i in requested}
        skipped = [i for i, _ in found[:limit] if i not in done]
        return BulkCancel(
            cancelled=sorted(cancelled, key=lambda i: i.id),
            requested=sorted(requested, key=lambda i: i.id),
            skipped=skipped,
            more=more,
        )

    async def _cancel_queued(
        self, conn: AsyncConnection, ids: list[UUID], state: InstanceState, actor: str
    ) -> list[Instance]:
        """Scheduled or Enqueued → Cancelled, with history. Compare-and-set on ``state``: a
        claim that got there first (it is Processing now) makes its row match nothing."""
        return await move_instances(
            conn,
            self._clock(),
            ids,
            state,
            InstanceState.CANCELLED,
            actor=actor,
            reason=EndReason.CANCELLED_BEFORE_RUN,
        )

    async def _request_cancel(self, conn: AsyncConnection, ids: list[UUID]) -> list[Instance]:
        """Flag running attempts; their workers read it at the next heartbeat. Only rows still
        Processing or Failed are flagged (one that ended meanwhile has nothing to stop)."""
        if not ids:
            return []
        result = await conn.execute(
            update(job_instances)
            .where(job_instances.c.id.in_(ids), unindexed_state(job_instances.c, *RUNNING_STATES))
            .values(cancel_requested=True)
            .returning(*job_instances.c)
        )
        return [rows.instance_from_row(r._mapping) for r in result]
