"""A leader whose re-plan fails (a short outage) after its cache took the new definitions: the
job must still be planned, by the sweep's version check, the backstop for a dropped event."""

from __future__ import annotations

from typing import cast

from jobplane.bus.abc import Bus
from jobplane.definitions import announce
from jobplane.store.abc import LeaderStore
from jobplane.store.sql import SqlStore
from tests.scheduler_helpers import (
    DrivenClock,
    advance_until,
    applied,
    running_scheduler,
    swept,
)
from tests.store_helpers import define
from tests.worker_helpers import FlakyStore, wait_for


async def _total(store: SqlStore, key: str) -> int:
    return sum((await store.count_by_state(key)).values())


async def test_a_job_resumed_while_its_replan_fails_is_planned_by_the_next_sweep(
    store: SqlStore, memory_bus: Bus
) -> None:
    """The resume's event reached the leader, which cached the resumed definition and then
    failed to re-plan it (its read of the job's last tick refused: the event is dropped). The
    cache said "up to date" to every later version check: the job never fired again in this
    term. (The same for an edit: the old schedule went on.)"""
    await define(store, "tick", cron="* * * * * *")
    paused = await store.set_paused("tick", True, "test")
    flaky = FlakyStore(store)
    clock = DrivenClock(store)
    # Sweeps far apart: the event, not a sweep, brings the resume to the leader first.
    async with running_scheduler(
        cast(LeaderStore, flaky), memory_bus, clock=clock, sweep_interval_s=1.5
    ) as scheduler:
        await applied(scheduler, "tick", paused.version, paused=True)
        flaky.fail_next["last_occurrences"] = 1
        resumed = await store.set_paused("tick", False, "test")
        await announce(memory_bus, [resumed])

        async def refused() -> bool:
            return bool(flaky.refusals("last_occurrences"))

        await wait_for(refused, what="the re-plan's read to be refused")
        await applied(scheduler, "tick", resumed.version)
        await swept(scheduler, 2)  # the backstop's version check
        await advance_until(clock, lambda: _total(store, "tick"), 2, what="ticks after the resume")
