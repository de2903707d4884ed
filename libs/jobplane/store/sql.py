"""The store on SQLAlchemy Core, shared by both backends.

Writes run in :meth:`SqlStore._write` transactions. On Postgres the rows a write depends on are
locked (``FOR UPDATE``) and the hot paths are overridden with single statements
(:mod:`jobplane.store.postgres`); on SQLite every write transaction is ``BEGIN IMMEDIATE``, so
writes are serialised and the generic code below is already race-free.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Collection, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

from sqlalchemy import (
    ColumnElement,
    Insert,
    Row,
    and_,
    func,
    literal,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from jobplane.domain.models import (
    Claim,
    ClaimResult,
    Instance,
    InstanceFilter,
    InstanceSource,
    JobDefinition,
    LeaderLease,
    NewInstance,
    Outcome,
    Page,
    Transition,
    WorkerInfo,
)
from jobplane.domain.options import JobOptions, OnLimit
from jobplane.domain.states import InstanceState, check_transition
from jobplane.errors import (
    IllegalTransitionError,
    InstanceNotFoundError,
    JobNotFoundError,
    StoreUnavailableError,
)
from jobplane.store import rows
from jobplane.store.tables import (
    counters,
    instance_transitions,
    job_definitions,
    job_instances,
    job_slots,
    scheduler_leases,
    workers,
)

logger = logging.getLogger(__name__)

S = InstanceState
I = job_instances.c  # noqa: E741 - the instance table's columns, used everywhere below
LIMIT_REASON = "max concurrency reached"


class SqlStore:
    """Generic implementation of :class:`jobplane.store.abc.Store`.

    Owns ``engine`` and disposes of it in :meth:`close`.
    """

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    # -- plumbing --------------------------------------------------------------------------

    async def close(self) -> None:
        await self.engine.dispose()

    @asynccontextmanager
    async def _write(self) -> AsyncIterator[AsyncConnection]:
        """A write transaction; driver errors that mean "unreachable" become
        :class:`StoreUnavailableError`."""
        try:
            async with self.engine.begin() as conn:
                yield conn
        except (OperationalError, InterfaceError, OSError) as exc:
            if isinstance(exc, DBAPIError) and not _is_disconnect(exc):
                raise
            raise StoreUnavailableError(f"metadata store unavailable: {_first_line(exc)}") from exc

    _read = _write

    async def ping(self) -> None:
        async with self._read() as conn:
            await conn.execute(select(literal(1)))

    def _clock(self) -> ColumnElement[datetime]:
        """The database's current time, as an SQL expression."""
        return func.now()

    async def now(self) -> datetime:
        async with self._read() as conn:
            value = (await conn.execute(select(self._clock()))).scalar_one()
        return _aware(value)

    async def _now(self, conn: AsyncConnection) -> datetime:
        return _aware((await conn.execute(select(self._clock()))).scalar_one())

    def _insert(self, table: Any) -> Insert:
        dialect = self.engine.dialect.name
        if dialect == "postgresql":
            return postgresql.insert(table)
        return sqlite.insert(table)

    async def _next_tokens(self, conn: AsyncConnection, count: int) -> list[int]:
        """``count`` fresh claim tokens (SQLite: from the serialised ``counters`` row)."""
        top = (
            await conn.execute(
                update(counters)
                .where(counters.c.name == "claim_token")
                .values(value=counters.c.value + count)
                .returning(counters.c.value)
            )
        ).scalar_one()
        return list(range(top - count + 1, top + 1))

    async def _history(self, conn: AsyncConnection, records: list[dict[str, Any]]) -> None:
        """Insert transition records (``at`` defaults to the database's clock)."""
        if records:
            await conn.execute(instance_transitions.insert(), records)

    # -- definitions -----------------------------------------------------------------------

    async def register_definition(
        self, options: JobOptions, args_schema: dict[str, Any] | None, actor: str
    ) -> tuple[JobDefinition, bool]:
        async with self._write() as conn:
            now = await self._now(conn)
            inserted = await conn.execute(
                self._insert(job_definitions)
                .values(
                    key=options.key,
                    args_schema=args_schema,
                    created_at=now,
                    updated_at=now,
                    updated_by=actor,
                    **rows.definition_values(options),
                )
                .on_conflict_do_nothing(index_elements=["key"])  # type: ignore[attr-defined]
                .returning(job_definitions.c.key)
            )
            created = inserted.first() is not None
            await conn.execute(
                self._insert(job_slots)
                .values(job_key=options.key, used=0)
                .on_conflict_do_nothing(index_elements=["job_key"])  # type: ignore[attr-defined]
            )
            if not created:
                # Stored options win; only the argument schema follows the code.
                await conn.execute(
                    update(job_definitions)
                    .where(job_definitions.c.key == options.key)
                    .values(args_schema=args_schema)
                )
            row = (
                await conn.execute(
                    select(job_definitions).where(job_definitions.c.key == options.key)
                )
            ).one()
        return rows.definition_from_row(row._mapping), created

    async def save_definition(
        self, options: JobOptions, *, expected_version: int, actor: str
    ) -> JobDefinition | None:
        async with self._write() as conn:
            now = await self._now(conn)
            # Optimistic lock: two editors of one version cannot both win.
            row = (
                await conn.execute(
                    update(job_definitions)
                    .where(
                        job_definitions.c.key == options.key,
                        job_definitions.c.version == expected_version,
                    )
                    .values(
                        version=job_definitions.c.version + 1,
                        updated_at=now,
                        updated_by=actor,
                        **rows.definition_values(options),
                    )
                    .returning(*job_definitions.c)
                )
            ).first()
        return rows.definition_from_row(row._mapping) if row else None

    async def set_paused(self, key: str, paused: bool, actor: str) -> JobDefinition:
        async with self._write() as conn:
            now = await self._now(conn)
            row = (
                await conn.execute(
                    update(job_definitions)
                    .where(job_definitions.c.key == key)
                    .values(
                        paused=paused,
                        version=job_definitions.c.version + 1,
                        updated_at=now,
                        updated_by=actor,
                    )
                    .returning(*job_definitions.c)
                )
            ).first()
        if row is None:
            raise JobNotFoundError(key)
        return rows.definition_from_row(row._mapping)

    async def get_definition(self, key: str) -> JobDefinition:
        found = await self.list_definitions([key])
        if not found:
            raise JobNotFoundError(key)
        return found[0]

    async def list_definitions(self, keys: Collection[str] | None = None) -> list[JobDefinition]:
        query = select(job_definitions).order_by(job_definitions.c.key)
        if keys is not None:
            query = query.where(job_definitions.c.key.in_(list(keys)))
        async with self._read() as conn:
            result = await conn.execute(query)
            return [rows.definition_from_row(r._mapping) for r in result]

    async def definition_versions(self) -> dict[str, int]:
        async with self._read() as conn:
            result = await conn.execute(select(job_definitions.c.key, job_definitions.c.version))
            return {key: version for key, version in result}

    # -- instances -------------------------------------------------------------------------

    async def create_instances(self, new: Sequence[NewInstance]) -> list[Instance]:
        if not new:
            return []
        async with self._write() as conn:
            now = await self._now(conn)
            keys = {n.job_key for n in new}
            defs = {
                r.key: JobOptions.model_validate(r.options)
                for r in await conn.execute(
                    select(job_definitions.c.key, job_definitions.c.options).where(
                        job_definitions.c.key.in_(keys)
                    )
                )
            }
            for key in keys - defs.keys():
                raise JobNotFoundError(key)
            values = [_new_instance_values(n, defs[n.job_key], now) for n in new]
            # A duplicate cron occurrence or idempotency key is not inserted (unique indexes):
            # the existing instance stands in for it below.
            inserted_ids = {
                r.id
                for r in await conn.execute(
                    self._insert(job_instances)
                    .values(values)
                    .on_conflict_do_nothing()  # type: ignore[attr-defined]
                    .returning(I.id)
                )
            }
            await self._history(
                conn,
                [
                    {
                        "instance_id": v["id"],
                        "from_state": None,
                        "to_state": v["state"],
                        "actor": n.actor,
                        "reason": n.skip_reason,
                    }
                    for n, v in zip(new, values, strict=True)
                    if v["id"] in inserted_ids
                ],
            )
            return await self._resolve_created(conn, new, inserted_ids)

    async def _resolve_created(
        self, conn: AsyncConnection, new: Sequence[NewInstance], inserted: set[UUID]
    ) -> list[Instance]:
        """The instances standing for ``new``, in order: inserted, or the existing duplicate."""
        by_id = {
            r.id: rows.instance_from_row(r._mapping)
            for r in await conn.execute(select(job_instances).where(I.id.in_(inserted)))
        }
        result: list[Instance] = []
        for n in new:
            if n.id in by_id:
                result.append(by_id[n.id])
                continue
            if n.idempotency_key is not None:
                clause = and_(I.job_key == n.job_key, I.idempotency_key == n.idempotency_key)
            else:
                clause = and_(
                    I.job_key == n.job_key,
                    I.source == InstanceSource.CRON.value,
                    I.scheduled_at == n.scheduled_at,
                )
            row = (await conn.execute(select(job_instances).where(clause))).one()
            result.append(rows.instance_from_row(row._mapping))
        return result

    async def mark_published(self, ids: Collection[UUID]) -> None:
        if not ids:
            return
        async with self._write() as conn:
            await conn.execute(
                update(job_instances)
                .where(I.id.in_(list(ids)), I.state == S.ENQUEUED.value)
                .values(published_at=self._clock())
            )

    async def get_instance(self, instance_id: UUID) -> Instance:
        async with self._read() as conn:
            row = (
                await conn.execute(select(job_instances).where(I.id == instance_id))
            ).first()
        if row is None:
            raise InstanceNotFoundError(instance_id)
        return rows.instance_from_row(row._mapping)

    async def list_instances(
        self, filter: InstanceFilter, *, limit: int = 50, before: UUID | None = None
    ) -> Page:
        query = select(job_instances).order_by(I.id.desc()).limit(limit + 1)
        if filter.job_key is not None:
            query = query.where(I.job_key == filter.job_key)
        if filter.states:
            query = query.where(I.state.in_([s.value for s in filter.states]))
        if filter.created_after is not None:
            query = query.where(I.created_at >= filter.created_after)
        if filter.created_before is not None:
            query = query.where(I.created_at < filter.created_before)
        if filter.worker_id is not None:
            query = query.where(I.worker_id == filter.worker_id)
        if before is not None:
            query = query.where(I.id < before)
        async with self._read() as conn:
            found = [rows.instance_from_row(r._mapping) for r in await conn.execute(query)]
        more = len(found) > limit
        items = found[:limit]
        return Page(items=items, next_cursor=items[-1].id if more else None)

    async def transitions(self, instance_id: UUID) -> list[Transition]:
        t = instance_transitions.c
        async with self._read() as conn:
            result = await conn.execute(
                select(instance_transitions).where(t.instance_id == instance_id).order_by(t.seq)
            )
            return [rows.transition_from_row(r._mapping) for r in result]

    async def count_by_state(self, job_key: str | None = None) -> dict[InstanceState, int]:
        query = select(I.state, func.count()).group_by(I.state)
        if job_key is not None:
            query = query.where(I.job_key == job_key)
        async with self._read() as conn:
            return {S(state): count for state, count in await conn.execute(query)}

    # -- the attempt lifecycle -------------------------------------------------------------

    async def claim(
        self, ids: Sequence[UUID], worker_id: str, lease_s: float, jobs: Collection[str]
    ) -> ClaimResult:
        if not ids:
            return ClaimResult()
        async with self._write() as conn:
            now = await self._now(conn)
            candidates = (
                await conn.execute(
                    select(I.id, I.job_key, I.priority)
                    .where(
                        I.id.in_(list(ids)),
                        I.state == S.ENQUEUED.value,
                        I.job_key.in_(list(jobs)),
                        or_(I.pinned_worker.is_(None), I.pinned_worker == worker_id),
                    )
                    .order_by(I.id)
                    .with_for_update()
                )
            ).all()
            slots = await self._lock_slots(conn, {c.job_key for c in candidates})
            claim_ids, skip_ids, wait_ids = _allot(candidates, slots)
            claimed = await self._take(conn, claim_ids, worker_id, now, lease_s)
            await self._end_excess(conn, skip_ids, worker_id)
            if wait_ids:
                # Parked until a slot frees: unpublished, so the releaser republishes it.
                await conn.execute(
                    update(job_instances)
                    .where(I.id.in_(wait_ids), I.state == S.ENQUEUED.value)
                    .values(published_at=None)
                )
        options = {key: opts for key, (_, opts) in slots.items()}
        handled = {*claim_ids, *skip_ids, *wait_ids}
        return ClaimResult(
            claimed=[Claim(instance=i, options=options[i.job_key]) for i in claimed],
            skipped=skip_ids,
            waiting=wait_ids,
            ignored=[i for i in dict.fromkeys(ids) if i not in handled],
        )

    async def _lock_slots(
        self, conn: AsyncConnection, keys: set[str]
    ) -> dict[str, tuple[int, JobOptions]]:
        """Lock the slot rows of ``keys`` (in key order: no deadlock between claimers) and
        return each key's free slots and current options."""
        if not keys:
            return {}
        result = await conn.execute(
            select(job_slots.c.job_key, job_slots.c.used, job_definitions.c.options)
            .join(job_definitions, job_definitions.c.key == job_slots.c.job_key)
            .where(job_slots.c.job_key.in_(keys))
            .order_by(job_slots.c.job_key)
            .with_for_update(of=job_slots)
        )
        out: dict[str, tuple[int, JobOptions]] = {}
        for key, used, raw in result:
            options = JobOptions.model_validate(raw)
            out[key] = (options.max_concurrency - used, options)
        return out

    async def _take(
        self,
        conn: AsyncConnection,
        ids: list[UUID],
        worker_id: str,
        now: datetime,
        lease_s: float,
    ) -> list[Instance]:
        if not ids:
            return []
        tokens = await self._next_tokens(conn, len(ids))
        claimed: list[Instance] = []
        for instance_id, token in zip(ids, tokens, strict=True):
            row = (
                await conn.execute(
                    update(job_instances)
                    .where(I.id == instance_id, I.state == S.ENQUEUED.value)
                    .values(
                        state=S.PROCESSING.value,
                        claim_token=token,
                        worker_id=worker_id,
                        lease_expires_at=now + timedelta(seconds=lease_s),
                        started_at=now,
                        attempt=I.attempt + 1,
                        progress=None,
                        progress_message=None,
                        reason=None,
                    )
                    .returning(*job_instances.c)
                )
            ).one()
            claimed.append(rows.instance_from_row(row._mapping))
        per_key: dict[str, int] = {}
        for instance in claimed:
            per_key[instance.job_key] = per_key.get(instance.job_key, 0) + 1
        for key, n in per_key.items():
            await conn.execute(
                update(job_slots).where(job_slots.c.job_key == key).values(used=job_slots.c.used + n)
            )
        await self._history(
            conn,
            [
                {
                    "instance_id": i.id,
                    "from_state": S.ENQUEUED.value,
                    "to_state": S.PROCESSING.value,
                    "actor": worker_id,
                    "claim_token": i.claim_token,
                }
                for i in claimed
            ],
        )
        return claimed

    async def _end_excess(self, conn: AsyncConnection, ids: list[UUID], actor: str) -> None:
        if not ids:
            return
        await conn.execute(
            update(job_instances)
            .where(I.id.in_(ids), I.state == S.ENQUEUED.value)
            .values(state=S.SKIPPED.value, finished_at=self._clock(), reason=LIMIT_REASON)
        )
        await self._history(
            conn,
            [
                {
                    "instance_id": i,
                    "from_state": S.ENQUEUED.value,
                    "to_state": S.SKIPPED.value,
                    "actor": actor,
                    "reason": LIMIT_REASON,
                }
                for i in ids
            ],
        )

    async def heartbeat(
        self, leases: Collection[tuple[UUID, int]], lease_s: float
    ) -> dict[UUID, bool]:
        if not leases:
            return {}
        async with self._write() as conn:
            now = await self._now(conn)
            result = await conn.execute(
                update(job_instances)
                .where(
                    tuple_(I.id, I.claim_token).in_(list(leases)),
                    I.state == S.PROCESSING.value,
                )
                .values(lease_expires_at=now + timedelta(seconds=lease_s))
                .returning(I.id, I.cancel_requested)
            )
            return {r.id: r.cancel_requested for r in result}

    async def complete(self, outcomes: Sequence[Outcome]) -> dict[UUID, InstanceState]:
        if not outcomes:
            return {}
        async with self._write() as conn:
            ended: dict[UUID, InstanceState] = {}
            for outcome in outcomes:
                check_transition(S.PROCESSING, outcome.state)
                moved = await self._move(
                    conn,
                    outcome.instance_id,
                    outcome.state,
                    expect=(S.PROCESSING,),
                    claim_token=outcome.claim_token,
                    actor=None,
                    reason=outcome.reason,
                    values={
                        "result": outcome.result,
                        "error": outcome.error.to_json() if outcome.error else None,
                    },
                )
                if moved is None:
                    logger.warning(
                        "outcome of instance %s refused: claim token %s no longer holds",
                        outcome.instance_id,
                        outcome.claim_token,
                        extra={"action": "store.fenced", "instance_id": str(outcome.instance_id)},
                    )
                    continue
                ended[moved.id] = moved.state
            failed = [o for o in outcomes if ended.get(o.instance_id) is S.FAILED]
            ended.update(await self._after_failure(conn, failed))
        return ended

    async def _after_failure(
        self, conn: AsyncConnection, failed: Sequence[Outcome]
    ) -> dict[UUID, InstanceState]:
        """Failed → Scheduled/Enqueued (a retry, attempts left) or → Terminated."""
        out: dict[UUID, InstanceState] = {}
        for outcome in failed:
            row = (
                await conn.execute(
                    select(I.retries_used, job_definitions.c.options)
                    .join(job_definitions, job_definitions.c.key == I.job_key)
                    .where(I.id == outcome.instance_id)
                )
            ).one()
            retries = JobOptions.model_validate(row.options).retries
            values: dict[str, Any] = {}
            if row.retries_used < retries:
                now = await self._now(conn)
                delay = max(outcome.retry_delay_s, 0.0)
                target = S.SCHEDULED if delay > 0 else S.ENQUEUED
                values = {
                    "retries_used": I.retries_used + 1,
                    "run_at": now + timedelta(seconds=delay),
                    "finished_at": None,
                }
                reason = f"retry {row.retries_used + 1} of {retries}"
            else:
                target, reason = S.TERMINATED, "no attempts left"
            moved = await self._move(
                conn,
                outcome.instance_id,
                target,
                expect=(S.FAILED,),
                claim_token=outcome.claim_token,
                actor=None,
                reason=reason,
                values=values,
            )
            if moved is not None:
                out[moved.id] = moved.state
        return out

    async def transition(
        self,
        instance_id: UUID,
        to_state: InstanceState,
        *,
        expect: Collection[InstanceState],
        claim_token: int | None = None,
        actor: str,
        reason: str | None = None,
    ) -> Instance | None:
        for state in expect:
            check_transition(state, to_state)
        async with self._write() as conn:
            return await self._move(
                conn,
                instance_id,
                to_state,
                expect=expect,
                claim_token=claim_token,
                actor=actor,
                reason=reason,
            )

    async def _move(
        self,
        conn: AsyncConnection,
        instance_id: UUID,
        to_state: InstanceState,
        *,
        expect: Collection[InstanceState],
        claim_token: int | None,
        actor: str | None,
        reason: str | None,
        values: dict[str, Any] | None = None,
    ) -> Instance | None:
        """One compare-and-set transition with its history and slot release, inside ``conn``'s
        transaction. ``actor=None`` means the worker holding the claim."""
        where = [I.id == instance_id, I.state.in_([s.value for s in expect])]
        if claim_token is not None:
            # Fencing: a stale attempt (lease lost, instance re-claimed) matches nothing.
            where.append(I.claim_token == claim_token)
        old = (
            await conn.execute(
                select(I.state, I.job_key, I.worker_id).where(*where).with_for_update()
            )
        ).first()
        if old is None:
            return None
        changes: dict[str, Any] = {"state": to_state.value, "reason": reason, **(values or {})}
        if to_state.is_terminal:
            changes["finished_at"] = self._clock()
        if old.state == S.PROCESSING.value:
            changes["lease_expires_at"] = None
        if to_state is S.ENQUEUED:
            changes["published_at"] = None  # to be published again by the caller or the sweep
        row = (
            await conn.execute(
                update(job_instances)
                .where(I.id == instance_id, I.state == old.state, *where[2:])
                .values(**changes)
                .returning(*job_instances.c)
            )
        ).one()
        if old.state == S.PROCESSING.value:
            # Leaving Processing gives the slot back in the same transaction.
            await conn.execute(
                update(job_slots)
                .where(job_slots.c.job_key == old.job_key)
                .values(used=job_slots.c.used - 1)
            )
        instance = rows.instance_from_row(row._mapping)
        await self._history(
            conn,
            [
                {
                    "instance_id": instance_id,
                    "from_state": old.state,
                    "to_state": to_state.value,
                    "actor": actor or old.worker_id or "system",
                    "reason": reason,
                    "claim_token": instance.claim_token,
                }
            ],
        )
        return instance

    async def request_cancel(self, instance_id: UUID, actor: str) -> Instance:
        async with self._write() as conn:
            row = (
                await conn.execute(
                    select(I.state).where(I.id == instance_id).with_for_update()
                )
            ).first()
            if row is None:
                raise InstanceNotFoundError(instance_id)
            state = S(row.state)
            if state in (S.SCHEDULED, S.ENQUEUED):
                moved = await self._move(
                    conn,
                    instance_id,
                    S.CANCELLED,
                    expect=(state,),
                    claim_token=None,
                    actor=actor,
                    reason="cancelled before it ran",
                )
                assert moved is not None  # the row is locked in this transaction
                return moved
            if state in (S.PROCESSING, S.FAILED):
                # The worker sees it on its next heartbeat (the bus only makes it faster).
                updated = (
                    await conn.execute(
                        update(job_instances)
                        .where(I.id == instance_id, I.state == state.value)
                        .values(cancel_requested=True)
                        .returning(*job_instances.c)
                    )
                ).one()
                return rows.instance_from_row(updated._mapping)
            raise IllegalTransitionError(state, S.CANCELLED)

    async def republish_waiting(self, job_keys: Collection[str], limit: int) -> list[Instance]:
        if not job_keys or limit <= 0:
            return []
        async with self._write() as conn:
            picked = (
                select(I.id)
                .where(
                    I.job_key.in_(list(job_keys)),
                    I.state == S.ENQUEUED.value,
                    I.published_at.is_(None),
                )
                .order_by(I.priority.desc(), I.id)
                .limit(limit)
                .with_for_update(skip_locked=True)
            )
            ids = list((await conn.execute(picked)).scalars())
            if not ids:
                return []
            result = await conn.execute(
                update(job_instances)
                .where(I.id.in_(ids), I.state == S.ENQUEUED.value)
                .values(published_at=self._clock())
                .returning(*job_instances.c)
            )
            return [rows.instance_from_row(r._mapping) for r in result]

    # -- workers and leadership ------------------------------------------------------------

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

    async def worker_heartbeat(self, worker_id: str) -> None:
        async with self._write() as conn:
            await conn.execute(
                update(workers).where(workers.c.id == worker_id).values(heartbeat_at=self._clock())
            )

    async def worker_stopped(self, worker_id: str) -> None:
        async with self._write() as conn:
            await conn.execute(
                update(workers).where(workers.c.id == worker_id).values(stopped_at=self._clock())
            )

    async def list_workers(self) -> list[WorkerInfo]:
        async with self._read() as conn:
            result = await conn.execute(select(workers).order_by(workers.c.id))
            return [rows.worker_from_row(r._mapping) for r in result]

    async def acquire_leadership(self, shard: int, holder: str, ttl_s: float) -> LeaderLease | None:
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
    from sqlalchemy import case

    return case((condition, then), else_=otherwise)


def _allot(
    candidates: Sequence[Row[Any]], slots: dict[str, tuple[int, JobOptions]]
) -> tuple[list[UUID], list[UUID], list[UUID]]:
    """Give each job key's free slots to its candidates by priority, then age (id)."""
    claim: list[UUID] = []
    skip: list[UUID] = []
    wait: list[UUID] = []
    ranked = sorted(candidates, key=lambda c: (c.job_key, -c.priority, c.id))
    taken: dict[str, int] = {}
    for c in ranked:
        free, options = slots[c.job_key]
        if taken.get(c.job_key, 0) < free:
            taken[c.job_key] = taken.get(c.job_key, 0) + 1
            claim.append(c.id)
        elif options.on_limit is OnLimit.SKIP:
            skip.append(c.id)
        else:
            wait.append(c.id)
    return claim, skip, wait


def _new_instance_values(n: NewInstance, options: JobOptions, now: datetime) -> dict[str, Any]:
    if n.skip_reason is not None:
        state = S.SKIPPED
    elif n.held or (n.run_at is not None and n.run_at > now):
        state = S.SCHEDULED
    else:
        state = S.ENQUEUED
    return {
        "id": n.id,
        "job_key": n.job_key,
        "state": state.value,
        "source": n.source.value,
        "queue": n.queue or options.queue,
        "priority": options.priority if n.priority is None else n.priority,
        "args": n.args,
        "created_at": now,
        "scheduled_at": n.scheduled_at,
        "run_at": None if n.held else n.run_at,
        "finished_at": now if state.is_terminal else None,
        "pinned_worker": n.pinned_worker,
        "retry_of": n.retry_of,
        "idempotency_key": n.idempotency_key,
        "reason": n.skip_reason,
    }


def _aware(value: datetime | str) -> datetime:
    if isinstance(value, str):  # SQLite returns CURRENT_TIMESTAMP-style strings
        value = datetime.fromisoformat(value)
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


_DISCONNECT_NAMES = frozenset(
    {
        "ConnectionDoesNotExistError",
        "CannotConnectNowError",
        "ConnectionFailureError",
        "AdminShutdownError",
        "InterfaceError",
    }
)


def _is_disconnect(exc: DBAPIError) -> bool:
    """Whether a driver error means "cannot reach the database" (not a bad statement)."""
    orig = exc.orig
    if exc.connection_invalidated or isinstance(orig, OSError):
        return True
    if type(orig).__name__ in _DISCONNECT_NAMES or type(orig.__cause__).__name__ in _DISCONNECT_NAMES:
        return True
    return "unable to open database" in str(orig)


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc)
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__
