"""What the Overview and Workers pages show about the cluster: workers and the leader."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from jobplane.domain.models import InstanceFilter, LeaderLease, WorkerInfo
from jobplane.domain.states import InstanceState
from jobplane.store.sql import SqlStore

#: A worker whose heartbeat is older than this is shown as silent (the leader's sweep marks
#: it stopped later, by its own setting).
SILENT_AFTER = timedelta(seconds=30)
#: The most running instances read to count each worker's busy slots.
RUNNING_READ = 10_000


@dataclass(frozen=True, slots=True)
class WorkerRow:
    info: WorkerInfo
    running: int
    silent: bool

    @property
    def stopped(self) -> bool:
        return self.info.stopped_at is not None


async def cluster_view(store: SqlStore) -> dict[str, Any]:
    """Workers (live first) with their busy slots, the scheduler leader's lease and the other
    scheduler replicas (standbys; silent when they have not campaigned for 30 s)."""
    now = await store.now()
    running = await store.list_instances(
        InstanceFilter(states=(InstanceState.PROCESSING,)), limit=RUNNING_READ
    )
    busy: dict[str, int] = {}
    for instance in running.items:
        if instance.worker_id:
            busy[instance.worker_id] = busy.get(instance.worker_id, 0) + 1
    rows = [WorkerRow(w, busy.get(w.id, 0), _silent(w, now)) for w in await store.list_workers()]
    online = [r for r in rows if not r.stopped]
    leader: LeaderLease | None = await store.get_leader(0)
    holder = leader.holder if leader else None
    standbys = [r for r in await store.list_schedulers(0) if r.holder != holder]
    return {
        "now": now,
        "workers": sorted(rows, key=lambda r: (r.stopped, r.info.id)),
        "online": len(online),
        "busy": sum(r.running for r in online),
        "capacity": sum(r.info.capacity for r in online),
        "leader": leader,
        "standbys": [(r, now - r.seen_at > SILENT_AFTER) for r in standbys],
    }


def _silent(worker: WorkerInfo, now: datetime) -> bool:
    beat = worker.heartbeat_at
    return worker.stopped_at is None and (beat is None or now - beat > SILENT_AFTER)
