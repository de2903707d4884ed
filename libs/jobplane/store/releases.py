"""A worker's release of an attempt it stopped because it could not renew its lease in time
(its fence): counted as the reaper counts the release of an expired lease."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from sqlalchemy import select

from jobplane.domain.models import Instance
from jobplane.domain.options import JobOptions
from jobplane.domain.reasons import EndReason
from jobplane.domain.states import InstanceState
from jobplane.store.base import SqlBase, retry_conflicts
from jobplane.store.moves import move_instances
from jobplane.store.tables import job_definitions, job_instances

columns = job_instances.c


class ReleaseStore(SqlBase):
    """The fenced release (generic: one row, the same statements on both backends)."""

    @retry_conflicts
    async def release_fenced(
        self, instance_id: UUID, claim_token: int, *, actor: str, reason: str
    ) -> Instance | None:
        """Processing → Enqueued with ``reason``, one unexpected retry counted (no retry
        used); Terminated once the job's ``max_unexpected_retries`` are used up; Cancelled if
        a cancel is pending. Fenced by ``claim_token``: ``None`` if the attempt no longer holds
        the instance (nothing written)."""
        async with self._write() as conn:
            # The row is locked: what is read here is what the move below compares with. A
            # release the reaper made meanwhile (it counted the unexpected retry itself) or a
            # new claim changed the state or the token: nothing matches, nothing is counted.
            row = (
                await conn.execute(
                    select(
                        columns.unexpected_retries_used,
                        columns.cancel_requested,
                        job_definitions.c.options,
                    )
                    .join(job_definitions, job_definitions.c.key == columns.job_key)
                    .where(
                        columns.id == instance_id,
                        columns.state == InstanceState.PROCESSING.value,
                        columns.claim_token == claim_token,
                    )
                    .with_for_update(of=job_instances)
                )
            ).first()
            if row is None:
                return None
            # The reaper's choices, in its order: a fenced attempt's release is as unexpected
            # as an expired lease's. Uncounted, a job that always outlives the fence (one that
            # blocks its event loop for most of the lease) was released and run for ever.
            allowed = JobOptions.from_stored(row.options).max_unexpected_retries
            values: dict[str, Any] = {}
            if row.cancel_requested:
                to_state, why = InstanceState.CANCELLED, EndReason.CANCEL_BEFORE_CLAIM.value
            elif row.unexpected_retries_used >= allowed:
                to_state, why = InstanceState.TERMINATED, EndReason.EXHAUSTED.value
            else:
                to_state, why = InstanceState.ENQUEUED, reason
                values = {"unexpected_retries_used": columns.unexpected_retries_used + 1}
            moved = await move_instances(
                conn,
                self._clock(),
                [instance_id],
                InstanceState.PROCESSING,
                to_state,
                claim_token=claim_token,
                actor=actor,
                reason=why,
                values=values,
            )
            return moved[0] if moved else None
