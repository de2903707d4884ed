"""The scheduler's own metrics move when it fires, misfires and sweeps (real Postgres and
Redis, the scheduler in the test's event loop)."""

from __future__ import annotations

from datetime import timedelta

from jobplane.bus.abc import Bus
from jobplane.domain.models import InstanceSource, NewInstance, WorkerInfo
from jobplane.store.sql import SqlStore
from jobplane_scheduler.health import render_metrics
from jobplane_scheduler.scheduler import Scheduler
from tests.scheduler_helpers import running_scheduler
from tests.store_helpers import define, enqueue
from tests.test_role_metrics import samples
from tests.worker_helpers import wait_for


def _value(scheduler: Scheduler, name: str, **labels: str) -> float:
    text = render_metrics(scheduler)[0].decode()
    return samples(text, name).get(tuple(sorted(labels.items())), 0.0)


async def test_ticks_fire_lag_and_sweeps_are_counted(pg_store: SqlStore, redis_bus: Bus) -> None:
    await define(pg_store, "tick", cron="* * * * * *")
    async with running_scheduler(pg_store, redis_bus) as scheduler:

        async def two_ticks() -> bool:
            return _value(scheduler, "jobplane_scheduler_ticks_fired_total") >= 2

        await wait_for(two_ticks, timeout_s=10, what="two ticks counted")
        assert _value(scheduler, "jobplane_scheduler_fire_lag_seconds_count") >= 2
        # Each tick is recorded well under a second after its scheduled time.
        lag_sum = _value(scheduler, "jobplane_scheduler_fire_lag_seconds_sum")
        lag_count = _value(scheduler, "jobplane_scheduler_fire_lag_seconds_count")
        assert 0 <= lag_sum / lag_count < 1.0
        assert _value(scheduler, "jobplane_scheduler_sweep_duration_seconds_count") >= 1
        assert _value(scheduler, "jobplane_scheduler_leader") == 1
        assert _value(scheduler, "jobplane_scheduler_leader_term") >= 1
    assert _value(scheduler, "jobplane_scheduler_leader") == 0  # resigned on stop


async def test_misfires_are_counted_by_policy(pg_store: SqlStore, redis_bus: Bus) -> None:
    await define(pg_store, "tick", cron="* * * * * *", misfire="skip", misfire_grace_s=0.5)
    lease = await pg_store.acquire_leadership(0, "earlier", 30)
    assert lease is not None
    tick = (await pg_store.now()).replace(microsecond=0) - timedelta(seconds=5)
    occurrence = NewInstance(job_key="tick", source=InstanceSource.CRON, scheduled_at=tick)
    await pg_store.fire(lease, [occurrence])
    await pg_store.release_leadership(0, "earlier", lease.term)
    # The new leader finds the ticks missed since: the policy skips them.
    async with running_scheduler(pg_store, redis_bus) as scheduler:

        async def skipped() -> bool:
            name = "jobplane_scheduler_misfires_total"
            return _value(scheduler, name, policy="skip", outcome="skipped") >= 4

        await wait_for(skipped, timeout_s=10, what="misfires counted")
        fired = _value(
            scheduler, "jobplane_scheduler_misfires_total", policy="skip", outcome="fired"
        )
        assert fired == 0


async def test_sweep_steps_are_counted(pg_store: SqlStore, redis_bus: Bus) -> None:
    await define(pg_store, "job", max_concurrency=5)
    info = WorkerInfo(id="w1", host="h", pid=1, queues=("default",), capacity=1, version="x")
    await pg_store.register_worker(info)
    [claimed, _] = await enqueue(pg_store, n=2)  # never published: the sweep publishes them
    result = await pg_store.claim([claimed.id], "w1", 0.1, ["job"])
    assert result.claimed
    async with running_scheduler(pg_store, redis_bus, dead_worker_after_s=0.5) as scheduler:

        async def swept() -> bool:
            steps = ("expired_leases", "dead_workers", "republished")
            name = "jobplane_scheduler_swept_total"
            return all(_value(scheduler, name, step=step) >= 1 for step in steps)

        await wait_for(swept, timeout_s=10, what="sweep steps counted")
        assert _value(scheduler, "jobplane_scheduler_swept_total", step="promoted") == 0
