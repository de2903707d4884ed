"""Instances: batch creation with history, reads, keyset listings."""

from __future__ import annotations

import functools
from collections.abc import Collection, Sequence
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from sqlalchemy import (
    ColumnElement,
    Select,
    String,
    and_,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from jobplane.domain.limits import BULK_RETRY_KEY_PREFIX
from jobplane.domain.models import (
    Instance,
    InstanceFilter,
    InstanceSource,
    JobDefinition,
    LeaderLease,
    NewInstance,
    Page,
    Transition,
)
from jobplane.domain.options import JobOptions
from jobplane.domain.states import QUEUED_STATES, InstanceState
from jobplane.errors import (
    InstanceNotFoundError,
    JobNotFoundError,
    StaleDefinitionError,
)
from jobplane.idempotency import fingerprint_of, replayed
from jobplane.ids import ID_CLOCK_SKEW, id_floor
from jobplane.store import rows
from jobplane.store.base import (
    SqlBase,
    in_slices,
    locked_in_id_order,
    plan_for_these_ids,
    retry_conflicts,
    unindexed_state,
)
from jobplane.store.creation import (
    INSERT_HISTORY,
    history_values,
    insert_instances,
    instance_values,
    replay_candidates,
)
from jobplane.store.engine import AsyncConnection
from jobplane.store.tables import (
    instance_counts,
    instance_transitions,
    job_definitions,
    job_instances,
)


class InstanceStore(SqlBase):
    """Instance creation and reads."""

    @retry_conflicts
    async def create_instances(
        self,
        new: Sequence[NewInstance],
        *,
        fence: LeaderLease | None = None,
        published: bool = False,
    ) -> list[Instance]:
        if not new:
            return []
        async with self._write() as conn:
            await self._fence(conn, fence)
            return await self._create(conn, new, published=published)

    async def _create(
        self, conn: AsyncConnection, new: Sequence[NewInstance], *, published: bool = False
    ) -> list[Instance]:
        """The body of :meth:`create_instances`, in the caller's transaction. With
        ``published``, the Enqueued ones are recorded as published by their insert (the
        caller sends them next, and clears the mark if it cannot), not by a second write."""
        now = await self._now(conn)
        keys = {n.job_key for n in new}
        defs = {
            r.key: JobOptions.from_stored(r.options)
            for r in await conn.execute(
                select(job_definitions.c.key, job_definitions.c.options).where(
                    job_definitions.c.key.in_(keys)
                )
            )
        }
        for key in keys - defs.keys():
            raise JobNotFoundError(key)
        values = [instance_values(n, defs[n.job_key], now) for n in new]
        for v in values:  # (every row names the same columns: one statement for them all)
            v["published_at"] = now if published and v["state"] == "enqueued" else None
        # A duplicate cron occurrence or idempotency key is not inserted (unique indexes):
        # the existing instance stands in for it below.
        dialect = self.engine.dialect.name
        inserted = await conn.execute(insert_instances(dialect), values)
        inserted_ids = {r.id for r in inserted}
        history = [
            history_values(n, v)
            for n, v in zip(new, values, strict=True)
            if v["id"] in inserted_ids
        ]
        if history:
            await conn.execute(INSERT_HISTORY, history)
        by_id = {
            r.id: rows.instance_from_row(r._mapping)
            for r in await conn.execute(
                select(job_instances).where(job_instances.c.id.in_(inserted_ids))
            )
        }
        return await self._resolve_created(conn, new, by_id)

    @retry_conflicts
    async def create_published(self, new: NewInstance, definition: JobDefinition) -> Instance:
        async with self._write() as conn:
            found = (
                await conn.execute(
                    select(job_definitions.c.version, job_definitions.c.args_schema).where(
                        job_definitions.c.key == new.job_key
                    )
                )
            ).first()
            if found is None or tuple(found) != (definition.version, definition.args_schema):
                raise StaleDefinitionError(new.job_key, definition.version)
            # (A replayed idempotency key: the first instance, as it is.)
            [instance] = await self._create(conn, [new], published=True)
            return instance

    async def unmark_published(self, ids: Collection[UUID]) -> None:
        if not ids:
            return
        async with self._write() as conn:
            await _set_published(conn, ids, None)

    async def _check_keys(self, conn: AsyncConnection, keys: set[str]) -> None:
        """Raise JobNotFoundError for the first key without a definition."""
        found = set(
            (
                await conn.execute(
                    select(job_definitions.c.key).where(job_definitions.c.key.in_(keys))
                )
            ).scalars()
        )
        for key in sorted(keys - found):
            raise JobNotFoundError(key)

    async def _resolve_created(
        self, conn: AsyncConnection, new: Sequence[NewInstance], by_id: dict[UUID, Instance]
    ) -> list[Instance]:
        """The instances standing for ``new``, in order: inserted (``by_id``), or the existing
        duplicate (a cron occurrence or an idempotency key seen before)."""
        result: list[Instance] = []
        for n in new:
            if n.id in by_id:
                result.append(by_id[n.id])
                continue
            if n.idempotency_key is not None:
                result.append(await self._replayed(conn, n))
                continue
            clause = and_(
                job_instances.c.job_key == n.job_key,
                job_instances.c.source == InstanceSource.CRON.value,
                job_instances.c.scheduled_at == n.scheduled_at,
            )
            row = (await conn.execute(select(job_instances).where(clause))).one()
            result.append(rows.instance_from_row(row._mapping))
        return result

    async def replay_of(self, new: NewInstance) -> Instance | None:
        if new.idempotency_key is None:
            return None
        async with self._read() as conn:
            found = await _replay_candidates(conn, new)
        return _replay(new, found) if found else None

    async def retry_under_key(self, retry_of: UUID, key: str) -> Instance | None:
        i = job_instances.c
        query = select(job_instances).where(i.idempotency_key == key, i.retry_of == retry_of)
        async with self._read() as conn:
            found = (await conn.execute(query.limit(1))).first()
        return rows.instance_from_row(found._mapping) if found is not None else None

    async def _replayed(self, conn: AsyncConnection, n: NewInstance) -> Instance:
        """The instance created earlier under ``n``'s idempotency key, if it was created
        for the same request; else raise IdempotencyConflictError (the caller's transaction
        rolls back: nothing of the batch is created)."""
        return _replay(n, await _replay_candidates(conn, n))

    @retry_conflicts
    async def mark_published(
        self, ids: Collection[UUID], *, fence: LeaderLease | None = None
    ) -> None:
        if not ids:
            return
        async with self._write() as conn:
            await self._fence(conn, fence)
            await _set_published(conn, ids, self._clock())

    async def still_enqueued(self, ids: Collection[UUID]) -> set[UUID]:
        if not ids:
            return set()
        async with self._read() as conn:
            result = await conn.execute(
                select(job_instances.c.id).where(
                    job_instances.c.id.in_(list(ids)),
                    unindexed_state(job_instances.c, InstanceState.ENQUEUED),
                )
            )
            return set(result.scalars())

    async def get_instance(self, instance_id: UUID) -> Instance:
        async with self._read() as conn:
            row = (
                await conn.execute(select(job_instances).where(job_instances.c.id == instance_id))
            ).first()
        if row is None:
            raise InstanceNotFoundError(instance_id)
        return rows.instance_from_row(row._mapping)

    async def list_instances(
        self, filter: InstanceFilter, *, limit: int = 50, before: UUID | None = None
    ) -> Page:
        query = (
            filtered(select(job_instances), filter)
            .order_by(job_instances.c.id.desc())
            .limit(limit + 1)
        )
        if before is not None:
            query = query.where(job_instances.c.id < before)
        async with self._read() as conn:
            found = [rows.instance_from_row(r._mapping) for r in await conn.execute(query)]
        more = len(found) > limit
        items = found[:limit]
        return Page(items=items, next_cursor=items[-1].id if more else None)

    async def recent_ends(self, job_key: str, limit: int) -> list[Instance]:
        # ix_job_instances_job_key_finished_at, newest end first: at most ``limit`` rows read.
        query = (
            select(job_instances)
            .where(job_instances.c.job_key == job_key, job_instances.c.finished_at.is_not(None))
            .order_by(job_instances.c.finished_at.desc())
            .limit(limit)
        )
        async with self._read() as conn:
            return [rows.instance_from_row(r._mapping) for r in await conn.execute(query)]

    async def transitions(self, instance_id: UUID) -> list[Transition]:
        t = instance_transitions.c
        async with self._read() as conn:
            result = await conn.execute(
                select(instance_transitions).where(t.instance_id == instance_id).order_by(t.seq)
            )
            return [rows.transition_from_row(r._mapping) for r in result]

    async def count_by_state(
        self, job_key: str | None = None, *, job_keys: Collection[str] | None = None
    ) -> dict[InstanceState, int]:
        # The counters the triggers of migration 0017 keep: at most (jobs x states x shards)
        # rows, however many instances there are.
        count_cols = instance_counts.c
        total = func.sum(count_cols.n)
        query = select(count_cols.state, total).group_by(count_cols.state).having(total != 0)
        if job_key is not None:
            query = query.where(count_cols.job_key == job_key)
        if job_keys is not None:
            query = query.where(count_cols.job_key.in_(list(job_keys)))
        async with self._read() as conn:
            return {InstanceState(state): int(count) for state, count in await conn.execute(query)}


def filtered(query: Select[Any], filter: InstanceFilter) -> Select[Any]:
    """``query`` restricted to the instances ``filter`` selects."""
    if filter.job_key is not None:
        query = query.where(job_instances.c.job_key == filter.job_key)
    if filter.job_keys is not None:
        query = query.where(job_instances.c.job_key.in_(filter.job_keys))
    if filter.states:
        query = query.where(job_instances.c.state.in_([s.value for s in filter.states]))
    # A created-time window also bounds the id (UUIDv7, time-ordered), so the listing reads
    # an index range instead of walking the primary key back from the newest row. Ids come
    # from the creating process's clock, created_at from the database's: the bound is widened
    # by ID_CLOCK_SKEW, and created_at stays the exact condition.
    if filter.created_after is not None:
        query = query.where(job_instances.c.created_at >= filter.created_after)
        if (low := _shifted(filter.created_after, -ID_CLOCK_SKEW)) is not None:
            query = query.where(job_instances.c.id >= id_floor(low))
    if filter.created_before is not None:
        query = query.where(job_instances.c.created_at < filter.created_before)
        if (high := _shifted(filter.created_before, ID_CLOCK_SKEW)) is not None:
            query = query.where(job_instances.c.id < id_floor(high))
    if filter.scheduled_after is not None:
        query = query.where(job_instances.c.scheduled_at >= filter.scheduled_after)
    if filter.scheduled_before is not None:
        query = query.where(job_instances.c.scheduled_at < filter.scheduled_before)
    if filter.worker_id is not None:
        query = query.where(job_instances.c.worker_id == filter.worker_id)
    return _bulk_selection(query, filter)


def _bulk_selection(query: Select[Any], filter: InstanceFilter) -> Select[Any]:
    """The conditions of a bulk action's selection (``InstanceFilter.for_cancel``, and
    ``for_retry``)."""
    if filter.cancellable:
        # Running and told to stop already: a cancel has nothing left to change.
        query = query.where(
            or_(
                job_instances.c.cancel_requested.is_(False),
                job_instances.c.state.in_([s.value for s in QUEUED_STATES]),
            )
        )
    if filter.unretried:
        # No bulk retry of it yet. One probe of the (job, idempotency key) index per row: a
        # retry keeps its instance's job.
        retry = job_instances.alias("retry")
        query = query.where(
            ~select(retry.c.id)
            .where(
                retry.c.job_key == job_instances.c.job_key,
                retry.c.idempotency_key == BulkRetryKey(job_instances.c.id),
            )
            .exists()
        )
    return query


class BulkRetryKey(FunctionElement[str]):
    """:func:`~jobplane.domain.limits.bulk_retry_key` of an instance id column, in SQL."""

    type = String()
    name = "bulk_retry_key"
    inherit_cache = True


@compiles(BulkRetryKey)
def _bulk_retry_key(element: BulkRetryKey, compiler: SQLCompiler, **kw: Any) -> str:
    # Postgres writes a uuid as text in the form Python's str() gives.
    return f"'{BULK_RETRY_KEY_PREFIX}' || CAST({compiler.process(element.clauses, **kw)} AS TEXT)"


@compiles(BulkRetryKey, "sqlite")
def _bulk_retry_key_sqlite(element: BulkRetryKey, compiler: SQLCompiler, **kw: Any) -> str:
    # SQLite holds a uuid as its 32 hex digits: the dashes go back in where str() puts them.
    hex_id = compiler.process(element.clauses, **kw)
    parts = " || '-' || ".join(
        f"substr({hex_id}, {start}, {length})"
        for start, length in ((1, 8), (9, 4), (13, 4), (17, 4), (21, 12))
    )
    return f"'{BULK_RETRY_KEY_PREFIX}' || lower({parts})"


async def _replay_candidates(conn: AsyncConnection, n: NewInstance) -> list[Instance]:
    """The instances already holding ``n``'s idempotency key (see ``replay_candidates``)."""
    assert n.idempotency_key is not None
    found = await conn.execute(replay_candidates(n.idempotency_key, n.job_key))
    return [rows.instance_from_row(r._mapping) for r in found]


def _replay(n: NewInstance, found: list[Instance]) -> Instance:
    """Which of ``found`` stands for ``n``; IdempotencyConflictError if none does."""
    assert n.idempotency_key is not None
    return replayed(found, n.idempotency_key, n.job_key, fingerprint_of(n), n.args, n.pinned_worker)


async def _set_published(
    conn: AsyncConnection, ids: Collection[UUID], value: ColumnElement[datetime] | None
) -> None:
    """Set or clear the publication mark of the Enqueued ones among ``ids`` (a claimed row
    needs no message any more). Rows a concurrent transaction holds are skipped, not waited
    for: a claim (which locks in id order too) makes them Processing, and a claimed row needs
    no mark; a row left with the wrong mark is only republished by the sweep. So this
    bookkeeping never waits on, nor deadlocks with, a claim."""
    ordered = sorted(ids)
    # Planned for these ids (see plan_for_these_ids): from a generic plan cached on a small
    # table, a mark of 1,000 took 0.41 to 0.43 s at 100,000 rows, and a burst of batch
    # triggers slowed from 15,000 to 1,100 instances/s as the table grew.
    await plan_for_these_ids(conn)
    # In slices, in id order: a batch trigger of the Python API may name more instances than
    # a statement takes parameters.
    for some in in_slices(ordered):
        await conn.execute(
            update(job_instances)
            .where(locked_in_id_order(functools.partial(_enqueued_among, some), skip_locked=True))
            .values(published_at=value)
        )


def _enqueued_among(ids: list[UUID], columns: Any) -> ColumnElement[bool]:
    named: ColumnElement[bool] = columns.id.in_(ids)
    return named & unindexed_state(columns, InstanceState.ENQUEUED)


def _shifted(moment: datetime, delta: timedelta) -> datetime | None:
    """``moment + delta``, or None past the calendar's ends (then no id bound is added)."""
    try:
        return moment + delta
    except OverflowError:
        return None
