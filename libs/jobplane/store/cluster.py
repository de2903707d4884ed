"""Workers and the scheduler's leader lease."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import (
    ColumnElement,
    and_,
    case,
    or_,
    select,
    update,
)

from jobplane.domain.models import (
    LeaderLease,
    SchedulerReplica,
    WorkerInfo,
)
from jobplane.store import rows
from jobplane.store.base import SqlBase, retry_conflicts
from jobplane.store.lifecycle import release_runaway_rows
from jobplane.store.tables import (
    runaway_slots,
    scheduler_leases,
    scheduler_replicas,
    workers,
)

#: A replica's row is deleted by the next campaign of any replica once it is this silent.
REPLICA_FORGOTTEN_AFTER = timedelta(hours=1)


class ClusterStore(SqlBase):
    """Worker registry and leader election."""

    @retry_conflicts
    async def register_worker(self, info: WorkerInfo) -> None:
        async with self._write() as conn:
            now = await self._now(conn)
            values = {
                "id": info.id,
                "host": info.host,
                "pid": info.pid,
                "queues": list(info.queues),
                "jobs": list(info.jobs),
                "capacity": info.capacity,
                "version": info.version,
                "started_at": now,
                "heartbeat_at": now,
                "stopped_at": None,
            }
            stmt = self._insert(workers).values(values)
            await conn.execute(
                stmt.on_conflict_do_update(  # type: ignore[attr-defined]
                    index_elements=["id"],
                    set_={k: v for k, v in values.items() if k != "id"},
                )
            )
            # A worker that registers runs no job yet: slots still held under its id by
            # runaway code are a previous process's (killed before the sweep saw it silent).
            await release_runaway_rows(conn, runaway_slots.c.worker_id == info.id)

    @retry_conflicts
    async def worker_heartbeat(self, worker_id: str) -> bool:
        async with self._write() as conn:
            # Conditional on the worker not being marked stopped: the dead-worker sweep gave
            # its runaway slots back and its pinned instances away, so a worker found dead
            # must learn it (and stop), not be revived by its next heartbeat.
            alive = (
                await conn.execute(
                    update(workers)
                    .where(workers.c.id == worker_id, workers.c.stopped_at.is_(None))
                    .values(heartbeat_at=self._clock())
                    .returning(workers.c.id)
                )
            ).first()
        return alive is not None

    @retry_conflicts
    async def worker_stopped(self, worker_id: str) -> None:
        async with self._write() as conn:
            await conn.execute(
                update(workers).where(workers.c.id == worker_id).values(stopped_at=self._clock())
            )

    async def list_workers(self) -> list[WorkerInfo]:
        async with self._read() as conn:
            result = await conn.execute(select(workers).order_by(workers.c.id))
            return [rows.worker_from_row(r._mapping) for r in result]

    @retry_conflicts
    async def acquire_leadership(self, shard: int, holder: str, ttl_s: float) -> LeaderLease | None:
        await self._end_expired_holder(shard, holder)
        async with self._write() as conn:
            now = await self._now(conn)
            expires = now + timedelta(seconds=ttl_s)
            lease = scheduler_leases.c
            stmt = self._insert(scheduler_leases).values(
                shard=shard, holder=holder, term=1, acquired_at=now, expires_at=expires
            )
            excluded = stmt.excluded  # type: ignore[attr-defined]
            renewing = and_(lease.holder == excluded.holder, lease.expires_at > now)
            row = (
                await conn.execute(
                    stmt.on_conflict_do_update(  # type: ignore[attr-defined]
                        index_elements=["shard"],
                        set_={
                            "holder": excluded.holder,
                            # A new holder (or an expired one coming back) starts a new term;
                            # every leader write checks the term, fencing the old leader off.
                            "term": _case(renewing, lease.term, lease.term + 1),
                            "acquired_at": _case(renewing, lease.acquired_at, excluded.acquired_at),
                            "expires_at": excluded.expires_at,
                        },
                        where=or_(lease.holder == excluded.holder, lease.expires_at <= now),
                    ).returning(*scheduler_leases.c)
                )
            ).first()
        return rows.lease_from_row(row._mapping) if row else None

    async def _end_expired_holder(self, shard: int, holder: str) -> None:
        """Before another replica takes an expired lease: end what the expired holder still
        holds on the lease row (Postgres). Nothing to do where writes are serialised."""

    async def release_leadership(self, shard: int, holder: str, term: int) -> bool:
        lease = scheduler_leases.c
        async with self._write() as conn:
            now = await self._now(conn)
            result = await conn.execute(
                update(scheduler_leases)
                .where(lease.shard == shard, lease.holder == holder, lease.term == term)
                .values(expires_at=now - timedelta(microseconds=1))
                .returning(lease.shard)
            )
            return result.first() is not None

    @retry_conflicts
    async def scheduler_seen(self, shard: int, holder: str) -> None:
        replica = scheduler_replicas.c
        async with self._write() as conn:
            now = await self._now(conn)
            stmt = self._insert(scheduler_replicas).values(
                shard=shard, holder=holder, started_at=now, seen_at=now
            )
            await conn.execute(
                stmt.on_conflict_do_update(  # type: ignore[attr-defined]
                    index_elements=["shard", "holder"], set_={"seen_at": now}
                )
            )
            # Replicas that died without saying so (a new pid is a new holder): the table
            # holds at most an hour of them (a handful of rows; the scan is trivial).
            await conn.execute(
                scheduler_replicas.delete().where(replica.seen_at < now - REPLICA_FORGOTTEN_AFTER)
            )

    async def scheduler_gone(self, shard: int, holder: str) -> None:
        replica = scheduler_replicas.c
        async with self._write() as conn:
            await conn.execute(
                scheduler_replicas.delete().where(replica.shard == shard, replica.holder == holder)
            )

    async def list_schedulers(self, shard: int) -> list[SchedulerReplica]:
        replica = scheduler_replicas.c
        async with self._read() as conn:
            result = await conn.execute(
                select(scheduler_replicas)
                .where(replica.shard == shard)
                .order_by(replica.seen_at.desc(), replica.holder)
            )
            return [rows.replica_from_row(r._mapping) for r in result]

    async def get_leader(self, shard: int) -> LeaderLease | None:
        lease = scheduler_leases.c
        async with self._read() as conn:
            row = (
                await conn.execute(
                    select(scheduler_leases).where(
                        lease.shard == shard, lease.expires_at > self._clock()
                    )
                )
            ).first()
        return rows.lease_from_row(row._mapping) if row else None


def _case(condition: ColumnElement[bool], then: Any, otherwise: Any) -> ColumnElement[Any]:
    return case((condition, then), else_=otherwise)
