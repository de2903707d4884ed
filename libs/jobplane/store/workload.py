"""What the workers are busy with, for the dashboard: running attempts per worker and the
slots held by runaway code. Both read rows bounded by the cluster's capacity, not the table."""

from __future__ import annotations

from sqlalchemy import func, select

from jobplane.domain.models import RunawaySlot
from jobplane.domain.states import InstanceState
from jobplane.store.base import SqlBase
from jobplane.store.tables import job_instances, runaway_slots

#: The most runaway slots listed (each one holds a pool thread of a live worker, so a
#: cluster has few; the rest are counted, not listed).
RUNAWAYS_LISTED = 200


class WorkloadStore(SqlBase):
    async def running_by_worker(self) -> dict[str, int]:
        # ix_job_instances_state_id: only the Processing rows are read.
        query = (
            select(job_instances.c.worker_id, func.count())
            .where(
                job_instances.c.state == InstanceState.PROCESSING.value,
                job_instances.c.worker_id.is_not(None),
            )
            .group_by(job_instances.c.worker_id)
        )
        async with self._read() as conn:
            return {worker: n for worker, n in await conn.execute(query)}

    async def runaway_slots(self) -> list[RunawaySlot]:
        runaway_cols = runaway_slots.c
        query = (
            select(
                runaway_cols.instance_id,
                runaway_cols.claim_token,
                runaway_cols.job_key,
                runaway_cols.worker_id,
                runaway_cols.held_since,
            )
            .order_by(runaway_cols.held_since)
            .limit(RUNAWAYS_LISTED)
        )
        async with self._read() as conn:
            return [RunawaySlot(*row) for row in await conn.execute(query)]
