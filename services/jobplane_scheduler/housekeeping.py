"""The leader's housekeeping, once a minute: retention of finished instances (when set), and
workers stopped long ago forgotten, their rows in Postgres and their keys in Redis."""

from __future__ import annotations

import logging
from datetime import timedelta

from jobplane.bus.abc import Bus
from jobplane.domain.models import LeaderLease
from jobplane.errors import BusUnavailableError
from jobplane.store.abc import LeaderStore

logger = logging.getLogger(__name__)

#: How long a stopped worker is kept: listed by the API, and its jobs still count as known to
#: the unknown-jobs sweep for ``unknown_job_timeout_s`` after it stopped (the longer rules).
STOPPED_WORKERS_KEPT = timedelta(days=1)


async def delete_finished(store: LeaderStore, days: float, lease: LeaderLease) -> None:
    """Retention: terminal instances finished more than ``days`` ago go, in batches."""
    before = await store.now() - timedelta(days=days)
    while await store.delete_finished_before(before, fence=lease):
        pass


async def forget_stopped_workers(
    store: LeaderStore, bus: Bus, kept: timedelta, lease: LeaderLease
) -> list[str]:
    """Forget the workers stopped more than ``kept`` ago: their rows, then on the bus their
    own streams and their consumers in the queues' groups. Every process start is a worker of
    its own, so these added up for ever (and every unknown-jobs sweep read every row). Returns
    the ids forgotten. What the bus could not forget (Redis away, entries still pending on a
    consumer) is logged and left: a few keys, never an instance."""
    before = await store.now() - kept
    forgotten: list[str] = []
    while gone := await store.forget_stopped_workers(before, fence=lease):
        for worker in gone:
            forgotten.append(worker.id)
            try:
                if await bus.forget_worker(worker.id, worker.queues):
                    continue
                why = "entries are still pending on its consumer"
            except BusUnavailableError as exc:
                why = str(exc)
            logger.warning(
                "forgot stopped worker %s, but not all of its keys in Redis: %s",
                worker.id,
                why,
                extra={"action": "scheduler.worker_keys_kept", "worker_id": worker.id},
            )
    return forgotten
