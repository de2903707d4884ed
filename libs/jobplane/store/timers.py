"""The leader's timers in the store: what comes due before its next sweep, so that it wakes
for it rather than waiting for the sweep (delayed instances to promote, leases that end)."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import select

from jobplane.domain.states import InstanceState
from jobplane.store.base import SqlBase
from jobplane.store.tables import job_instances


class TimerStore(SqlBase):
    """The reads behind the leader's timers (see ``LeaderDuties._sleep_until_sweep``)."""

    async def scheduled_due_within(self, seconds: float) -> list[datetime]:
        """``run_at`` of Scheduled instances due within ``seconds`` (the leader's timers)."""
        async with self._read() as conn:
            horizon = await self._now(conn) + timedelta(seconds=seconds)
            result = await conn.execute(
                select(job_instances.c.run_at)
                .where(
                    job_instances.c.state == InstanceState.SCHEDULED.value,
                    job_instances.c.run_at.is_not(None),
                    job_instances.c.run_at <= horizon,
                )
                .order_by(job_instances.c.run_at)
                .limit(1000)
            )
            return [at for at in result.scalars() if at is not None]

    async def leases_ending_within(self, seconds: float) -> list[datetime]:
        """The distinct ``lease_expires_at`` of Processing instances within ``seconds`` (the
        leader's timers: a dead worker's attempts are released when their leases end, not at
        the next sweep). An attempt renewed since is simply not expired when the leader wakes.
        A batch of leases claimed or renewed together shares one end (the transaction's
        time), so the list is short even for a worker with many attempts."""
        async with self._read() as conn:
            horizon = await self._now(conn) + timedelta(seconds=seconds)
            ends = job_instances.c.lease_expires_at
            result = await conn.execute(
                select(ends)
                .where(
                    job_instances.c.state == InstanceState.PROCESSING.value,
                    ends.is_not(None),
                    ends <= horizon,
                )
                .group_by(ends)
                .order_by(ends)
                .limit(100)
            )
            return [at for at in result.scalars() if at is not None]


__all__ = ["TimerStore"]
