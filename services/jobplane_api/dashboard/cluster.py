"""What the Overview and Workers pages show about the cluster: workers and the leader."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from jobplane.domain.models import LeaderLease, RunawaySlot, WorkerInfo
from jobplane.store.abc import ApiStore
from jobplane_api.dashboard.reads import PageReads

#: A worker whose heartbeat is older than this is shown as silent (the leader's sweep marks
#: it stopped later, by its own setting).
SILENT_AFTER = timedelta(seconds=30)


@dataclass(frozen=True, slots=True)
class WorkerRow:
    info: WorkerInfo
    running: int
    silent: bool
    runaways: list[RunawaySlot]

    @property
    def stopped(self) -> bool:
        return self.info.stopped_at is not None


async def app_jobs(store: ApiStore, app: str) -> tuple[str, ...] | None:
    """The keys of the jobs ``app`` registered (``None``: no app, every job)."""
    if not app:
        return None
    return tuple(sorted(d.key for d in await store.list_definitions(app=app)))


async def cluster_view(
    store: ApiStore, reads: PageReads, jobs: Collection[str] | None = None
) -> dict[str, Any]:
    """Workers (live first) with their busy slots and runaway slots, the scheduler leader's
    lease and the other scheduler replicas (standbys; silent when they have not campaigned
    for 30 s). With ``jobs``, only the workers that registered one of them (an app's
    workers); the scheduler replicas are the cluster's. The reads are independent: they are
    started together on ``reads``."""
    now_read = reads.read(store.now)
    busy_read = reads.read(store.running_by_worker)
    slots_read = reads.read(store.runaway_slots)
    workers_read = reads.read(store.list_workers)
    leader_read = reads.read(store.get_leader, 0)
    replicas_read = reads.read(store.list_schedulers, 0)
    now, busy = await now_read, await busy_read
    runaways: dict[str, list[RunawaySlot]] = {}
    for slot in await slots_read:
        runaways.setdefault(slot.worker_id, []).append(slot)
    rows = [
        WorkerRow(w, busy.get(w.id, 0), _silent(w, now), runaways.get(w.id, []))
        for w in await workers_read
        if jobs is None or set(w.jobs) & set(jobs)
    ]
    online = [r for r in rows if not r.stopped]
    leader: LeaderLease | None = await leader_read
    holder = leader.holder if leader else None
    standbys = [r for r in await replicas_read if r.holder != holder]
    return {
        "now": now,
        "workers": sorted(rows, key=lambda r: (r.stopped, r.info.id)),
        "online": len(online),
        "busy": sum(r.running for r in online),
        "capacity": sum(r.info.capacity for r in online),
        "leader": leader,
        "runaways": sum(len(r.runaways) for r in online),
        "standbys": [(r, now - r.seen_at > SILENT_AFTER) for r in standbys],
    }


def _silent(worker: WorkerInfo, now: datetime) -> bool:
    beat = worker.heartbeat_at
    return worker.stopped_at is None and (beat is None or now - beat > SILENT_AFTER)
