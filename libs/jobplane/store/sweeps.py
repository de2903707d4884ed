"""The leader's duties in the store: fire cron ticks, promote due instances, release expired
leases, mark dead workers, apply retention (what to republish is read in
:mod:`jobplane.store.publication`).

Every write made as leader runs in a transaction that first takes a share lock on the live
lease row of its term (:meth:`SweepStore._fence`). A takeover must update that row, so it waits
until the write has committed, and a deposed leader (its lease expired or taken, e.g. after a
SIGSTOP) finds no live row and writes nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from sqlalchemy import ColumnElement, Select, and_, delete, func, or_, select, update

from jobplane.domain.models import Instance, InstanceSource, LeaderLease, NewInstance, WorkerInfo
from jobplane.domain.options import JobOptions, PinFallback
from jobplane.domain.reasons import EndReason
from jobplane.domain.states import InstanceState
from jobplane.errors import DefinitionsChangedError, NotLeaderError, StoreRefusedError
from jobplane.store.abc import HeldFire
from jobplane.store.base import in_slices, logger, retry_conflicts
from jobplane.store.engine import AsyncConnection
from jobplane.store.lifecycle import release_runaway_rows
from jobplane.store.moves import move_instances, unpin
from jobplane.store.publication import PublicationStore
from jobplane.store.rows import worker_from_row
from jobplane.store.tables import (
    instance_counts,
    instance_transitions,
    job_definitions,
    job_instances,
    runaway_slots,
    workers,
)


class SweepStore(PublicationStore):
    """Leader-only operations. Each takes the leader's ``lease`` (its fencing token)."""

    async def fire(
        self,
        lease: LeaderLease,
        new: Sequence[NewInstance],
        *,
        published: bool = False,
        planned: Mapping[str, int] | None = None,
    ) -> list[Instance]:
        """Create cron occurrences (and misfire records) as leader. A tick already recorded is
        not created again (unique job key + scheduled time): the existing one is returned.
        With ``planned``, nothing is created if a job's stored version is not the one given
        (DefinitionsChangedError). With ``published``, the Enqueued ones are recorded as
        published by their insert, fenced by the same term."""
        if not new:
            return []
        async with self._write() as conn:
            await self._fence(conn, lease)
            if planned:
                d = job_definitions.c
                changed = [
                    key
                    for keys in in_slices(planned)
                    for key, version in await conn.execute(
                        select(d.key, d.version).where(d.key.in_(keys))
                    )
                    if version != planned[key]
                ]
                if changed:
                    raise DefinitionsChangedError(changed)
            return await self._create(  # type: ignore[attr-defined,no-any-return]
                conn, new, published=published
            )

    async def fire_ahead(
        self,
        lease: LeaderLease,
        new: Sequence[NewInstance],
        *,
        published: bool = False,
        planned: Mapping[str, int] | None = None,
    ) -> HeldFire | None:
        """None: this store writes a tick at its time only (SQLite serialises every write, so
        a transaction held open until the tick would stall every other one)."""
        return None

    async def last_occurrences(self, keys: Collection[str]) -> dict[str, datetime]:
        """The latest recorded cron tick of each job (fired or recorded as missed)."""
        if not keys:
            return {}
        found: dict[str, datetime] = {}
        async with self._read() as conn:
            for some in in_slices(keys):  # (the leader asks for every active recurring job)
                result = await conn.execute(
                    select(job_instances.c.job_key, func.max(job_instances.c.scheduled_at))
                    .where(
                        job_instances.c.job_key.in_(some),
                        job_instances.c.source == InstanceSource.CRON.value,
                    )
                    .group_by(job_instances.c.job_key)
                )
                found.update((key, at) for key, at in result if at is not None)
        return found

    @retry_conflicts
    async def promote_due(self, lease: LeaderLease, limit: int = 1000) -> list[Instance]:
        """Scheduled instances whose ``run_at`` has come (the database's clock) → Enqueued."""
        async with self._write() as conn:
            await self._fence(conn, lease)
            due = (
                (
                    await conn.execute(
                        select(job_instances.c.id)
                        .where(
                            job_instances.c.state == InstanceState.SCHEDULED.value,
                            job_instances.c.run_at.is_not(None),
                            job_instances.c.run_at <= self._clock(),
                        )
                        .order_by(job_instances.c.run_at)
                        .limit(limit)
                        .with_for_update(skip_locked=True)
                    )
                )
                .scalars()
                .all()
            )
            return await self._move_many(
                conn, list(due), InstanceState.SCHEDULED, InstanceState.ENQUEUED, "due", {}
            )

    async def promote_due_each(self, lease: LeaderLease, limit: int = 1000) -> list[Instance]:
        """:meth:`promote_due` one instance per transaction, for when the database refused the
        batch (a poison row: a constraint or trigger rejects it). An instance still refused is
        logged with its id and left Scheduled (tried again at the next sweep); the others are
        promoted."""
        async with self._read() as conn:
            due = list(
                await conn.scalars(
                    select(job_instances.c.id)
                    .where(
                        job_instances.c.state == InstanceState.SCHEDULED.value,
                        job_instances.c.run_at.is_not(None),
                        job_instances.c.run_at <= self._clock(),
                    )
                    .order_by(job_instances.c.run_at)
                    .limit(limit)
                )
            )
        promoted: list[Instance] = []
        for instance_id in due:
            try:
                async with self._write() as conn:
                    await self._fence(conn, lease)
                    promoted += await self._move_many(
                        conn,
                        [instance_id],
                        InstanceState.SCHEDULED,
                        InstanceState.ENQUEUED,
                        "due",
                        {},
                    )
            except StoreRefusedError as exc:
                logger.error(
                    "the database refused to promote instance %s: %s",
                    instance_id,
                    exc,
                    extra={"action": "store.promotion_refused", "instance_id": str(instance_id)},
                )
        return promoted

    @retry_conflicts
    async def release_expired(self, lease: LeaderLease, limit: int = 1000) -> list[Instance]:
        """Attempts whose lease expired: released to Enqueued (no retry used, one unexpected
        retry counted), Terminated once unexpected retries are exhausted, or Cancelled if a
        cancel was pending. The slot goes back in the same transaction."""
        async with self._write() as conn:
            await self._fence(conn, lease)
            expired = (
                await conn.execute(
                    select(
                        job_instances.c.id,
                        job_instances.c.unexpected_retries_used,
                        job_instances.c.cancel_requested,
                        job_definitions.c.options,
                    )
                    .join(job_definitions, job_definitions.c.key == job_instances.c.job_key)
                    .where(
                        job_instances.c.state == InstanceState.PROCESSING.value,
                        job_instances.c.lease_expires_at < self._clock(),
                    )
                    .order_by(job_instances.c.lease_expires_at)
                    .limit(limit)
                    .with_for_update(of=job_instances, skip_locked=True)
                )
            ).all()
            cancel = [r.id for r in expired if r.cancel_requested]
            exhausted: list[UUID] = []
            release: list[UUID] = []
            for r in expired:
                if r.cancel_requested:
                    continue
                allowed = JobOptions.from_stored(r.options).max_unexpected_retries
                (exhausted if r.unexpected_retries_used >= allowed else release).append(r.id)
            out = await self._move_many(
                conn,
                release,
                InstanceState.PROCESSING,
                InstanceState.ENQUEUED,
                EndReason.LEASE_EXPIRED,
                {"unexpected_retries_used": job_instances.c.unexpected_retries_used + 1},
            )
            await self._move_many(
                conn,
                exhausted,
                InstanceState.PROCESSING,
                InstanceState.TERMINATED,
                EndReason.EXHAUSTED,
                {},
            )
            await self._move_many(
                conn,
                cancel,
                InstanceState.PROCESSING,
                InstanceState.CANCELLED,
                EndReason.CANCELLED_WORKER_LOST,
                {},
            )
            return out

    async def _move_many(
        self,
        conn: AsyncConnection,
        ids: list[UUID],
        from_state: InstanceState,
        to_state: InstanceState,
        reason: str,
        values: dict[str, Any],
    ) -> list[Instance]:
        """Compare-and-set the rows ``ids`` (locked by the caller) ``from_state → to_state``
        as the scheduler: one UPDATE, its side effects, slots and history
        (:func:`~jobplane.store.moves.move_instances`)."""
        return await move_instances(
            conn,
            self._clock(),
            ids,
            from_state,
            to_state,
            actor="scheduler",
            reason=reason,
            values=values,
        )

    @retry_conflicts
    async def resolve_orphaned_pins(
        self, lease: LeaderLease, unaware_after_s: float | None = None
    ) -> list[tuple[Instance, str]]:
        """Enqueued instances pinned to a worker that is gone (stopped, marked dead, or never
        registered), or, with ``unaware_after_s``, to a live worker that has not registered
        their job, for instances waiting longer than that: unpinned for any worker
        (``pin_fallback=any``; returned with the worker they were pinned to, to publish on
        the queue) or Terminated (``fail``), each with a reason that says which."""
        async with self._write() as conn:
            await self._fence(conn, lease)
            unaware: list[tuple[str, list[str]]] = []
            before = None
            if unaware_after_s is not None:
                # (A few rows.) Race: a worker that registers the job meanwhile has its pinned
                # instance unpinned or ended once the grace is over, not before.
                alive = select(workers.c.id, workers.c.jobs).where(workers.c.stopped_at.is_(None))
                unaware = [(r.id, list(r.jobs or [])) for r in await conn.execute(alive)]
                before = await self._now(conn) - timedelta(seconds=unaware_after_s)
            orphans = (await conn.execute(orphaned_pins(unaware=unaware, before=before))).all()
            live = {worker_id for worker_id, _ in unaware}
            fail = {
                r.id
                for r in orphans
                if JobOptions.from_stored(r.options).pin_fallback is PinFallback.FAIL
            }
            pinned_to = {r.id: r.pinned_worker for r in orphans}
            moved: list[Instance] = []
            for aware, (ended, unpinned) in (
                (False, (EndReason.PIN_GONE, EndReason.PIN_GONE_UNPINNED)),
                (True, (EndReason.PIN_UNAWARE, EndReason.PIN_UNAWARE_UNPINNED)),
            ):
                ids = [r.id for r in orphans if (r.pinned_worker in live) is aware]
                ending = [i for i in ids if i in fail]
                await self._move_many(
                    conn, ending, InstanceState.ENQUEUED, InstanceState.TERMINATED, ended, {}
                )
                moved += await unpin(conn, [i for i in ids if i not in fail], unpinned)
            return [(instance, pinned_to[instance.id]) for instance in moved]

    @retry_conflicts
    async def terminate_unknown_jobs(
        self, lease: LeaderLease, after_s: float, limit: int = 1000
    ) -> list[Instance]:
        """Enqueued → Terminated ("no worker knows the job") for instances waiting longer than
        ``after_s`` whose job no live worker has registered, nor any worker for as long (the
        time a stopped worker that had it stopped, or was last heard of, counts)."""
        async with self._write() as conn:
            await self._fence(conn, lease)
            cutoff = await self._now(conn) - timedelta(seconds=after_s)
            known: set[str] = set()  # by a live worker, or by one heard of since the cutoff
            for row in await conn.execute(
                select(workers.c.jobs, workers.c.heartbeat_at, workers.c.stopped_at)
            ):
                if row.stopped_at is None or (row.stopped_at or row.heartbeat_at) > cutoff:
                    known.update(row.jobs or [])
            # The jobs with Enqueued instances, from the counters (a few rows), so a sweep in
            # which every such job is known reads no instance: ``job_key NOT IN known`` read
            # every Enqueued row each second.
            counted = func.sum(instance_counts.c.n)
            enqueued_jobs = await conn.scalars(
                select(instance_counts.c.job_key)
                .where(instance_counts.c.state == InstanceState.ENQUEUED.value)
                .group_by(instance_counts.c.job_key)
                .having(counted > 0)
            )
            unknown = sorted(set(enqueued_jobs) - known)
            if not unknown:
                return []
            waiting = await conn.scalars(
                select(job_instances.c.id)
                .where(
                    job_instances.c.state == InstanceState.ENQUEUED.value,
                    job_instances.c.job_key.in_(unknown),
                    job_instances.c.created_at < cutoff,
                    or_(job_instances.c.run_at.is_(None), job_instances.c.run_at < cutoff),
                )
                .order_by(job_instances.c.id)
                .limit(limit)
                .with_for_update(skip_locked=True)
            )
            return await self._move_many(
                conn,
                list(waiting),
                InstanceState.ENQUEUED,
                InstanceState.TERMINATED,
                EndReason.NO_WORKER_KNOWS,
                {},
            )

    @retry_conflicts
    async def mark_dead_workers(
        self, silent_for_s: float, *, fence: LeaderLease | None = None
    ) -> list[str]:
        """Workers with no heartbeat for ``silent_for_s`` are marked stopped, and the slots
        still held by runaway code of any stopped worker are given back (its process is gone,
        and its threads with it), in the same transaction. With ``fence`` (the leader's
        lease), a deposed leader writes nothing (:class:`NotLeaderError`)."""
        await self._end_silent_workers(silent_for_s)
        async with self._write() as conn:
            await self._fence(conn, fence)
            cutoff = await self._now(conn) - timedelta(seconds=silent_for_s)
            result = await conn.execute(
                update(workers)
                .where(workers.c.stopped_at.is_(None), workers.c.heartbeat_at < cutoff)
                .values(stopped_at=self._clock())
                .returning(workers.c.id)
            )
            dead = list(result.scalars())
            # Read after the update above, in its transaction: the workers just marked are
            # among the stopped ones. A worker stops (``worker_stopped``) only once its job
            # threads have returned, so what a stopped worker still holds is a leftover.
            stopped = select(workers.c.id).where(workers.c.stopped_at.is_not(None))
            freed = await release_runaway_rows(conn, runaway_slots.c.worker_id.in_(stopped))
            if freed:
                logger.warning(
                    "released %d slot(s) held by runaway jobs of stopped workers (%s)",
                    sum(freed.values()),
                    ", ".join(sorted(freed)),
                    extra={"action": "store.runaway_slots_released"},
                )
            return dead

    @retry_conflicts
    async def forget_stopped_workers(
        self, before: datetime, limit: int = 100, *, fence: LeaderLease | None = None
    ) -> list[WorkerInfo]:
        """Delete the rows of up to ``limit`` workers stopped before ``before``, except one
        still holding a runaway slot (given back by :meth:`mark_dead_workers` first); return
        them. Each process start adds a row, kept once it stops (listed, and read by every
        unknown-jobs sweep): without this the table grew for ever. Fenced by ``fence``."""
        async with self._write() as conn:
            await self._fence(conn, fence)
            holding = select(runaway_slots.c.worker_id)
            doomed = (
                select(workers.c.id)
                .where(workers.c.stopped_at < before, workers.c.id.not_in(holding))
                .order_by(workers.c.stopped_at)
                .limit(limit)
            )
            result = await conn.execute(
                delete(workers).where(workers.c.id.in_(doomed)).returning(*workers.c)
            )
            return [worker_from_row(row._mapping) for row in result]

    async def _end_silent_workers(self, silent_for_s: float) -> None:
        """Before silent workers are marked dead: end their sessions still under way (Postgres;
        nothing to do where writes are serialised)."""

    @retry_conflicts
    async def delete_finished_before(
        self, before: datetime, limit: int = 1000, *, fence: LeaderLease | None = None
    ) -> int:
        """Retention: delete up to ``limit`` terminal instances finished before ``before``,
        with their history, except each recurring job's latest tick. Returns how many went
        (call again until 0). Fenced by ``fence`` like every leader write.

        The latest tick stays because the leader plans a job from it (see
        :meth:`last_occurrences`): a monthly job's tick deleted after a week of retention made
        the next re-plan (a restart, a failover, a resume, an edit) take it for missed and fire
        it again, and the unique occurrence key could not stop that with the row gone."""
        terminal = [s.value for s in InstanceState if s.is_terminal]
        i = job_instances.c
        ticks = job_instances.alias("ticks")
        latest_tick = (
            select(func.max(ticks.c.scheduled_at))
            .where(ticks.c.job_key == i.job_key, ticks.c.source == InstanceSource.CRON.value)
            .scalar_subquery()
        )
        async with self._write() as conn:
            await self._fence(conn, fence)
            ids = (
                (
                    await conn.execute(
                        select(job_instances.c.id)
                        .where(
                            and_(
                                job_instances.c.state.in_(terminal),
                                job_instances.c.finished_at < before,
                                # (the latest tick is read from uq_job_instances_cron_occurrence)
                                or_(
                                    i.source != InstanceSource.CRON.value,
                                    i.scheduled_at < latest_tick,
                                ),
                            )
                        )
                        .order_by(job_instances.c.finished_at)
                        .limit(limit)
                        .with_for_update(skip_locked=True)
                    )
                )
                .scalars()
                .all()
            )
            if not ids:
                return 0
            await conn.execute(
                delete(instance_transitions).where(instance_transitions.c.instance_id.in_(ids))
            )
            await conn.execute(delete(job_instances).where(job_instances.c.id.in_(ids)))
            return len(ids)


def orphaned_pins(
    limit: int = 1000,
    *,
    unaware: Sequence[tuple[str, Sequence[str]]] = (),
    before: datetime | None = None,
) -> Select[Any]:
    """Enqueued instances pinned to a worker that is not live (id, the pin, the job's options),
    locked, up to ``limit``: read from ``ix_job_instances_pinned_enqueued`` (migration 0021),
    which holds the pinned Enqueued instances only, when the planner's statistics know the
    backlog (without it, each sweep read every Enqueued row). With ``unaware`` (live workers'
    ids and the jobs each registered) and ``before``, also those created before ``before``
    and pinned to one of them that has not registered their job: no worker may run them (a
    worker that does not know the job puts its entry back; another's claim refuses the pin)."""
    live = select(workers.c.id).where(workers.c.stopped_at.is_(None))
    stuck: ColumnElement[bool] = job_instances.c.pinned_worker.not_in(live)
    if unaware and before is not None:
        lacking = [
            and_(job_instances.c.pinned_worker == worker_id, job_instances.c.job_key.not_in(jobs))
            for worker_id, jobs in unaware
        ]
        stuck = or_(stuck, and_(job_instances.c.created_at < before, or_(*lacking)))
    return (
        select(job_instances.c.id, job_instances.c.pinned_worker, job_definitions.c.options)
        .join(job_definitions, job_definitions.c.key == job_instances.c.job_key)
        .where(
            job_instances.c.state == InstanceState.ENQUEUED.value,
            job_instances.c.pinned_worker.is_not(None),
            stuck,
        )
        .limit(limit)
        .with_for_update(of=job_instances, skip_locked=True)
    )


__all__ = ["NotLeaderError", "SweepStore", "orphaned_pins"]
