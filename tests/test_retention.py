"""Retention as the leader runs it: old terminal instances go, and what the leader plans from
stays."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import update

from jobplane.bus.abc import Bus
from jobplane.domain.models import InstanceFilter, Outcome
from jobplane.domain.states import InstanceState as S
from jobplane.store.sql import SqlStore
from jobplane.store.tables import job_definitions, job_instances
from jobplane_scheduler.cron_timers import occurrence
from tests.scheduler_helpers import running_scheduler, swept
from tests.store_helpers import define
from tests.worker_helpers import wait_for


async def _ticks(store: SqlStore) -> list[tuple[datetime | None, S]]:
    page = await store.list_instances(InstanceFilter(job_key="monthly"), limit=100)
    return sorted(((i.scheduled_at, i.state) for i in page.items), key=lambda t: str(t[0]))


async def _ran_long_ago(store: SqlStore, ticks: list[datetime]) -> None:
    """Fire ``ticks`` as a leader of the past did, run them, and date their ends 8 days back."""
    lease = await store.acquire_leadership(0, "leader-of-the-past", 5.0)
    assert lease is not None
    made = await store.fire(lease, [occurrence("monthly", t) for t in ticks])
    await store.release_leadership(0, "leader-of-the-past", lease.term)
    claimed = (await store.claim([i.id for i in made], "w1", 30.0, ["monthly"])).claimed
    await store.complete([Outcome(c.instance.id, c.token, S.SUCCEEDED) for c in claimed])
    values: dict[str, Any] = {"finished_at": await store.now() - timedelta(days=8)}
    async with store.engine.begin() as conn:
        await conn.execute(update(job_instances).values(**values))


async def test_a_restart_after_retention_does_not_fire_a_jobs_latest_tick_again(
    store: SqlStore, memory_bus: Bus
) -> None:
    """A monthly job under a 7-day retention. Its latest tick was deleted with the older ones:
    the next leader (a restart, a failover; a resume or an edit re-plans the same way) found
    no tick recorded, took that one for missed and fired it a second time."""
    now = await store.now()
    latest = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    before = (latest - timedelta(days=1)).replace(day=1)
    await define(store, "monthly", cron="0 0 1 * *", max_concurrency=5)
    async with store.engine.begin() as conn:  # (the job exists since before both ticks)
        await conn.execute(
            update(job_definitions).values(
                created_at=before - timedelta(days=1), schedule_since=None
            )
        )
    await _ran_long_ago(store, [before, latest])
    async with running_scheduler(store, memory_bus, retention_days=7) as first:

        async def older_tick_deleted() -> bool:
            return all(at != before for at, _ in await _ticks(store))

        await wait_for(older_tick_deleted, what="retention to delete the older tick")
        await swept(first, 3)
    assert await _ticks(store) == [(latest, S.SUCCEEDED)]
    async with running_scheduler(store, memory_bus, retention_days=7) as second:
        await swept(second, 3)
    assert await _ticks(store) == [(latest, S.SUCCEEDED)]
