"""What the leader's republish sweep reads: the Enqueued instances whose message may be lost
(never published, or published long ago and still unclaimed), a page at a time, and every
Enqueued instance after the bus lost everything. Reads only: the sweep publishes what it finds
lost through the dispatcher, which records the publication."""

from __future__ import annotations

from collections.abc import Collection
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

from sqlalchemy import Select, and_, literal, or_, select, true, tuple_

from jobplane.domain.models import Instance
from jobplane.domain.states import InstanceState
from jobplane.store import rows
from jobplane.store.abc import PublishedKey
from jobplane.store.base import SqlBase, unindexed_state
from jobplane.store.tables import job_definitions, job_instances, job_slots

NEVER_PUBLISHED_GRACE_S = 0.5


def never_published_grace(older_than_s: float) -> float:
    """How long after its creation the republish sweep takes an instance never published as
    lost (a publisher normally records its publication within milliseconds): the grace, or
    the sweep's own ``older_than_s`` if that is shorter."""
    return min(older_than_s, NEVER_PUBLISHED_GRACE_S)


#: Before every published instance in (publication time, id) order: where the first page of
#: :meth:`PublicationStore.unpublished` starts.
FIRST_PUBLISHED: PublishedKey = (datetime(1, 1, 1, tzinfo=UTC), UUID(int=0))


class PublicationStore(SqlBase):
    """The republish sweep's reads (the leader's, through
    :class:`~jobplane.store.sweeps.SweepStore`)."""

    async def unpublished(
        self, older_than_s: float, limit: int = 1000, *, after: PublishedKey | None = None
    ) -> list[Instance]:
        """Enqueued instances whose message may be gone: never published (half a second after
        creation), or published longer ago than ``older_than_s`` and still unclaimed.
        Instances parked by ``on_limit=wait`` (unpublished on purpose) are included only while
        their job has a free slot, so a full job is not republished on every sweep. Never
        published first, then by (publication time, id), after ``after`` if given: the sweep
        walks a backlog page by page without rewriting what it finds in place. (Postgres
        reads them job by job: ``UNPUBLISHED`` in :mod:`jobplane.store.postgres_sql`.)"""
        async with self._read() as conn:
            now = await self._now(conn)
            cutoff = now - timedelta(seconds=older_than_s)
            fresh = now - timedelta(seconds=never_published_grace(older_than_s))
            c = job_instances.c
            past = true() if after is None else tuple_(c.published_at, c.id) > tuple_(*after)
            result = await conn.execute(
                select(job_instances)
                .join(job_slots, job_slots.c.job_key == job_instances.c.job_key)
                .join(job_definitions, job_definitions.c.key == job_instances.c.job_key)
                .where(
                    job_instances.c.state == InstanceState.ENQUEUED.value,
                    or_(
                        # Never published: enqueued in the application's own transaction,
                        # or its publisher died between commit and publish.
                        and_(
                            job_instances.c.published_at.is_(None),
                            job_instances.c.created_at < fresh,
                        ),
                        and_(job_instances.c.published_at < cutoff, past),
                    ),
                    job_slots.c.used < job_definitions.c.max_concurrency,
                )
                .order_by(job_instances.c.published_at.nulls_first(), job_instances.c.id)
                .limit(limit)
            )
            return [rows.instance_from_row(r._mapping) for r in result]

    async def unpublished_among(self, ids: Collection[UUID]) -> list[Instance]:
        """Those of ``ids`` still Enqueued and never published (announced by a notification
        from an in-transaction enqueue)."""
        if not ids:
            return []
        async with self._read() as conn:
            result = await conn.execute(
                select(job_instances).where(
                    job_instances.c.id.in_(list(ids)),
                    unindexed_state(job_instances.c, InstanceState.ENQUEUED),
                    job_instances.c.published_at.is_(None),
                )
            )
            return [rows.instance_from_row(r._mapping) for r in result]

    async def all_enqueued(self, after: UUID | None, limit: int = 1000) -> list[Instance]:
        """Every Enqueued instance, in id order (republished after the bus lost everything)."""
        async with self._read() as conn:
            result = await conn.execute(enqueued_page(after, limit))
            return [rows.instance_from_row(r._mapping) for r in result]


#: Above every instance id: the end of the range of :func:`enqueued_page`.
_LAST_ID = UUID(int=(1 << 128) - 1)


def enqueued_page(after: UUID | None, limit: int) -> Select[Any]:
    """The Enqueued instances with an id above ``after``, the first ``limit`` in id order.

    Written as a range of (state, id) pairs, which only ``ix_job_instances_state_id`` answers,
    and in its order: a page reads its rows and stops. Written as ``state = 'enqueued' AND id >
    :after``, it let the planner take the index of the Enqueued rows of each job whenever its
    statistics missed the backlog (that is, when the bus lost everything during a burst): every
    page then read and sorted the whole backlog, and the republication cost its square."""
    columns = job_instances.c
    pair = tuple_(columns.state, columns.id)

    def at(instance_id: UUID) -> Any:
        return tuple_(
            literal(InstanceState.ENQUEUED.value, columns.state.type),
            literal(instance_id, columns.id.type),
        )

    first = pair >= at(UUID(int=0)) if after is None else pair > at(after)
    return (
        select(job_instances)
        .where(first, pair <= at(_LAST_ID))
        .order_by(job_instances.c.state, job_instances.c.id)
        .limit(limit)
    )
