"""Small builders shared by the store tests, typed against the interfaces they use (a test
may hand them any store that has those: the roles' stores, the whole ``Store``)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from jobplane.domain.models import Instance, NewInstance
from jobplane.domain.options import JobOptions
from jobplane.domain.states import InstanceState
from jobplane.store.abc import DispatchStore, Registration
from jobplane.store.sql import SqlStore
from jobplane.store.tables import job_slots


async def define(store: Registration, key: str = "job", **options: Any) -> JobOptions:
    kind = "recurring" if "cron" in options else "triggered"
    parsed = JobOptions.parse(key=key, kind=options.pop("kind", kind), **options)
    await store.register_definition(parsed, None, "test")
    return parsed


async def enqueue(store: DispatchStore, key: str = "job", n: int = 1, **kw: Any) -> list[Instance]:
    return await store.create_instances([NewInstance(job_key=key, **kw) for _ in range(n)])


def max_running(transitions: list[tuple[int, InstanceState | None, InstanceState]]) -> int:
    """Replay history in sequence order; the most instances ever Processing at once."""
    running = peak = 0
    for _, from_state, to_state in sorted(transitions, key=lambda t: t[0]):
        if to_state is InstanceState.PROCESSING:
            running += 1
        elif from_state is InstanceState.PROCESSING:
            running -= 1
        peak = max(peak, running)
    return peak


async def slots_used(store: SqlStore, key: str = "job") -> int:
    """The job's concurrency slots in use (its ``job_slots`` counter)."""
    async with store.engine.connect() as conn:
        used = await conn.scalar(select(job_slots.c.used).where(job_slots.c.job_key == key))
    assert used is not None, f"job {key!r} has no job_slots row"
    return int(used)
