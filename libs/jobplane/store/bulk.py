"""Bulk operations on the instances a filter selects: cancel many at once.

One transaction per call. The selected rows are locked in id order (the order claimers lock
in, so the two cannot deadlock); each change is still a compare-and-set on the state just
read, with its history record written in the same transaction.
"""

from __future__ import annotations

from uuid import UUID

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from jobplane.domain.models import BulkCancel, Instance, InstanceFilter
from jobplane.domain.reasons import EndReason
from jobplane.store import rows
from jobplane.store.base import I, S, SqlBase, retry_conflicts
from jobplane.store.instances import filtered
from jobplane.store.tables import job_instances

CANCEL_REASON = EndReason.CANCELLED_BEFORE_RUN

#: A cancel ends these at once ...
QUEUED = (S.SCHEDULED, S.ENQUEUED)
#: ... and asks the worker to stop these (as :meth:`Store.request_cancel` does).
RUNNING = (S.PROCESSING, S.FAILED)


class BulkStore(SqlBase):
    """Bulk changes selected by an :class:`InstanceFilter`."""

    @retry_conflicts
    async def cancel_many(self, filter: InstanceFilter, *, limit: int, actor: str) -> BulkCancel:
        async with self._write() as conn:
            # Lock what the filter selects, oldest first. A row that changed while we waited
            # for its lock is re-checked against the filter by Postgres (and SQLite writes are
            # serialised), so the states read here are the states the rows are in.
            found = (
                await conn.execute(
                    filtered(select(I.id, I.state), filter)
                    .order_by(I.id)
                    .limit(limit + 1)
                    .with_for_update()
                )
            ).all()
            more = len(found) > limit
            by_state: dict[S, list[UUID]] = {}
            for instance_id, state in found[:limit]:
                by_state.setdefault(S(state), []).append(instance_id)
            cancelled: list[Instance] = []
            for state in QUEUED:
                cancelled += await self._cancel_queued(conn, by_state.get(state, []), state, actor)
            running = [i for state in RUNNING for i in by_state.get(state, [])]
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
        self, conn: AsyncConnection, ids: list[UUID], state: S, actor: str
    ) -> list[Instance]:
        """Scheduled or Enqueued → Cancelled, with history. Compare-and-set on ``state``: a
        claim that got there first (it is Processing now) makes its row match nothing."""
        if not ids:
            return []
        result = await conn.execute(
            update(job_instances)
            .where(I.id.in_(ids), I.state == state.value)
            .values(state=S.CANCELLED.value, finished_at=self._clock(), reason=CANCEL_REASON)
            .returning(*job_instances.c)
        )
        moved = [rows.instance_from_row(r._mapping) for r in result]
        await self._history(
            conn,
            [
                {
                    "instance_id": i.id,
                    "from_state": state.value,
                    "to_state": S.CANCELLED.value,
                    "actor": actor,
                    "reason": CANCEL_REASON,
                }
                for i in moved
            ],
        )
        return moved

    async def _request_cancel(self, conn: AsyncConnection, ids: list[UUID]) -> list[Instance]:
        """Flag running attempts; their workers read it at the next heartbeat. Only rows still
        Processing or Failed are flagged (one that ended meanwhile has nothing to stop)."""
        if not ids:
            return []
        result = await conn.execute(
            update(job_instances)
            .where(I.id.in_(ids), I.state.in_([s.value for s in RUNNING]))
            .values(cancel_requested=True)
            .returning(*job_instances.c)
        )
        return [rows.instance_from_row(r._mapping) for r in result]
