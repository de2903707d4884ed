"""Small builders shared by the store tests."""

from __future__ import annotations

from typing import Any

from jobplane.domain.models import Instance, NewInstance
from jobplane.domain.options import JobOptions
from jobplane.domain.states import InstanceState
from jobplane.store.sql import SqlStore


async def define(store: SqlStore, key: str = "job", **options: Any) -> JobOptions:
    kind = "recurring" if "cron" in options else "triggered"
    parsed = JobOptions.parse(key=key, kind=options.pop("kind", kind), **options)
    await store.register_definition(parsed, None, "test")
    return parsed


async def enqueue(store: SqlStore, key: str = "job", n: int = 1, **kw: Any) -> list[Instance]:
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
