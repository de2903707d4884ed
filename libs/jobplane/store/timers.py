"""The leader's timers in the store: what comes due before its next sweep, so that it wakes
for it rather than waiting for the sweep (delayed instances to promote, leases that end)."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, select

from jobplane.domain.states import InstanceState
from jobplane.store.base import SqlBase
from jobplane.store.tables import job_instances


class TimerStore(SqlBase):
    """The reads behind the leader's timers (see ``LeaderDuties._sleep_until_sweep``)."""

    async def scheduled_due_within(self, seconds: float) -> list[datetime]:
        """``run_at`` of Scheduled instances due within ``seconds`` (the leader's timers)."""
        return await self._times_within(
            job_instances.c.run_at, InstanceState.SCHEDULED, seconds, limit=1000
        )

    async def leases_ending_within(self, seconds: float) -> list[datetime]:
        """The distinct ``lease_expires_at`` of Processing instances within ``seconds`` (the
        leader's timers: a dead worker's attempts are released when their leases end, not at
        the next sweep). An attempt renewed since is simply not expired when the leader wakes.
        A batch of leases claimed or renewed together shares one end (the transaction's
        time), so the list is short even for a worker with many attempts."""
        return await self._times_within(
            job_instances.c.lease_expires_at,
            InstanceState.PROCESSING,
            seconds,
            limit=100,
            distinct=True,
        )

    async def _times_within(
        self,
        column: ColumnElement[datetime | None],
        state: InstanceState,
        seconds: float,
        *,
        limit: int,
        distinct: bool = False,
    ) -> list[datetime]:
        """The values of ``column`` (a time) of instances in ``state`` up to ``seconds`` ahead
        on the store's clock (those already past included), earliest first."""
        async with self._read() as conn:
            horizon = await self._now(conn) + timedelta(seconds=seconds)
            query = select(column).where(
                job_instances.c.state == state.value, column.is_not(None), column <= horizon
            )
            if distinct:
                query = query.group_by(column)
            result = await conn.execute(query.order_by(column).limit(limit))
            return [at for at in result.scalars() if at is not None]


__all__ = ["TimerStore"]
