"""Postgres: the production store. Its hot paths are single statements written for Postgres
(data-modifying CTEs, ``FOR UPDATE``, ``RETURNING``): one round trip per claim batch and per
completion batch, history included."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from contextlib import AsyncExitStack
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from sqlalchemy import text

from jobplane.domain.models import (
    Claim,
    ClaimOutcome,
    ClaimResult,
    Instance,
    JobDefinition,
    LeaderLease,
    NewInstance,
    Outcome,
)
from jobplane.domain.options import JobOptions
from jobplane.domain.reasons import EndReason
from jobplane.domain.states import InstanceState, check_transition
from jobplane.errors import (
    DefinitionsChangedError,
    JobNotFoundError,
    NotLeaderError,
    StaleDefinitionError,
    StoreConflictError,
    StoreUnavailableError,
)
from jobplane.idempotency import fingerprint_of
from jobplane.store import rows
from jobplane.store.abc import HeldFire, PublishedKey
from jobplane.store.ahead import PostgresHeldFire
from jobplane.store.base import reachable, retry_conflicts
from jobplane.store.driver import DriverStatement
from jobplane.store.engine import AsyncConnection, AsyncEngine
from jobplane.store.lifecycle import log_fenced
from jobplane.store.postgres_fire_sql import FIRE, FIRE_AHEAD
from jobplane.store.postgres_sessions import END_EXPIRED_HOLDER, END_SILENT_WORKERS
from jobplane.store.postgres_sql import (
    CLAIM,
    COMPLETE,
    CREATE,
    CREATE_ONE,
    NOW,
    RENEW,
    UNPUBLISHED,
)
from jobplane.store.postgres_stats import PostgresStatsStore
from jobplane.store.publication import FIRST_PUBLISHED, never_published_grace
from jobplane.store.sql import SqlStore

logger = logging.getLogger(__name__)


async def _stop_listening(
    conn: AsyncConnection, driver: Any, channel: str, received: Callable[..., None]
) -> None:
    """UNLISTEN before the connection goes back to the pool. This runs while the listener is
    being torn down, often because its task was cancelled mid-outage: a connection the
    restart left half-open refuses the statement (asyncpg raises ``InternalClientError``,
    "another operation is in progress", not an ``InterfaceError``). Whatever it raises, the
    connection is discarded instead, so the pool never hands out one still listening, and the
    error never replaces the cancellation (it used to escape and stop the leader's duties)."""
    if driver.is_closed():
        return
    try:
        await driver.remove_listener(channel, received)
    except Exception as exc:  # any failure here means: do not reuse it
        logger.debug("discarding the connection that listened on %s: %s", channel, exc)
        await conn.invalidate()


class PostgresStore(PostgresStatsStore, SqlStore):
    concurrent_reads = True  # each read takes a pooled connection of its own

    def __init__(self, engine: AsyncEngine) -> None:
        super().__init__(engine)
        #: The single trigger's statement, run on the driver (see :class:`DriverStatement`).
        self._create_one = DriverStatement(CREATE_ONE, engine.dialect)
        self._fire = DriverStatement(FIRE, engine.dialect)
        self._fire_ahead = DriverStatement(FIRE_AHEAD, engine.dialect)
        self._create_batch = DriverStatement(CREATE, engine.dialect)
        self._claim = DriverStatement(CLAIM, engine.dialect)
        self._complete_one = DriverStatement(COMPLETE, engine.dialect)
        self._read_clock = DriverStatement(NOW, engine.dialect)
        self._end_holder = DriverStatement(END_EXPIRED_HOLDER, engine.dialect)
        self._end_workers = DriverStatement(END_SILENT_WORKERS, engine.dialect)

    async def now(self) -> datetime:
        # One round trip, not three (BEGIN, the read, COMMIT): the leader reads the clock to
        # plan each sleep of its cron loop and of its sweep's timers.
        async with reachable():
            row = await self._read_clock.run_row(self.engine, {})
        now: datetime = row["now"]
        return now

    async def _end_expired_holder(self, shard: int, holder: str) -> None:
        """End the sessions an expired holder of ``shard``'s lease still holds it with (see
        ``END_EXPIRED_HOLDER_SQL``): one statement on its own, before the takeover's
        transaction, which then finds the row free instead of waiting out its lock timeout
        behind a frozen leader, takeover after takeover."""
        async with reachable():
            ended = await self._end_holder.run(self.engine, {"shard": shard, "holder": holder})
        if ended:
            logger.warning(
                "ended %d session(s) of the expired leader of shard %d still holding its lease "
                "(pids %s): a frozen leader's write under way",
                len(ended),
                shard,
                ", ".join(str(row["pid"]) for row in ended),
                extra={"action": "store.expired_leader_ended", "shard": shard},
            )

    async def _end_silent_workers(self, silent_for_s: float) -> None:
        """End the active sessions of the workers about to be marked dead (see
        ``END_SILENT_WORKERS_SQL``), one statement before the marking's transaction."""
        async with reachable():
            ended = await self._end_workers.run(self.engine, {"silent_for_s": silent_for_s})
        if ended:
            logger.warning(
                "ended %d active session(s) of silent worker(s) %s before marking them dead: "
                "a frozen worker's statement under way",
                len(ended),
                ", ".join(sorted({str(row["worker_id"]) for row in ended})),
                extra={"action": "store.silent_worker_ended"},
            )

    async def notifications(self, channel: str) -> AsyncIterator[list[str]]:
        """Batches of payloads ``NOTIFY``-ed on ``channel`` (delivered on commit only), over
        one connection held for the purpose. Raises :class:`StoreUnavailableError` when that
        connection is lost; the caller listens again once the database is back."""
        queue: asyncio.Queue[str | None] = asyncio.Queue()

        def received(_conn: Any, _pid: int, _channel: str, payload: str) -> None:
            queue.put_nowait(payload)

        def lost(_conn: Any) -> None:
            queue.put_nowait(None)

        async with reachable(), self.engine.connect() as conn:
            raw = await conn.get_raw_connection()
            driver = raw.driver_connection
            assert driver is not None
            await driver.add_listener(channel, received)
            driver.add_termination_listener(lost)
            try:
                while True:
                    batch = [await queue.get()]
                    while not queue.empty():
                        batch.append(queue.get_nowait())
                    if None in batch:
                        raise StoreUnavailableError(f"lost the connection listening on {channel}")
                    yield [p for p in batch if p is not None]
            finally:
                driver.remove_termination_listener(lost)
                await _stop_listening(conn, driver, channel, received)

    async def unpublished(
        self, older_than_s: float, limit: int = 1000, *, after: PublishedKey | None = None
    ) -> list[Instance]:
        # The generic statement's conditions, read job by job (``UNPUBLISHED``).
        after_at, after_id = after or FIRST_PUBLISHED
        params = {
            "older": float(older_than_s),
            "grace": float(never_published_grace(older_than_s)),
            "limit": limit,
            "after_at": after_at,
            "after_id": after_id,
        }
        async with self._read() as conn:
            result = await conn.execute(UNPUBLISHED, params)
            return [rows.instance_from_row(r._mapping) for r in result]

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
        params = creation_params(new)
        params["published"] = published  # recorded by the insert (``CREATE``)
        async with self._write() as conn:
            await self._fence(conn, fence)
            await self._check_keys(conn, {n.job_key for n in new})
            # On the driver, in this transaction: only the columns the insert decided come
            # back, and each instance is built from its record (as the fire's).
            found = await self._create_batch.fetch(conn, params)
            records = {n.id: n for n in new}
            by_id = {row["id"]: rows.inserted_instance(records[row["id"]], row) for row in found}
            return await self._resolve_created(conn, new, by_id)

    @retry_conflicts
    async def fire(
        self,
        lease: LeaderLease,
        new: Sequence[NewInstance],
        *,
        published: bool = False,
        planned: Mapping[str, int] | None = None,
    ) -> list[Instance]:
        """As :meth:`create_instances` with the lease as fence, in one statement (``FIRE``:
        the fence, the key and version checks and the creation, and with ``published`` the
        publication mark), so a tick costs one round trip."""
        if not new:
            return []
        params = _fire_params(lease, new, published, planned)
        # On the driver (one statement, a transaction of its own): SQLAlchemy's processing of
        # a 1,000-row result cost the leader more CPU than the rows' own conversion, and the
        # publish waits for it (docs/benchmarks.md, "Cron fire lag").
        async with reachable(), self.engine.connect() as conn:
            by_id = self._fire_result(lease, new, await self._fire.fetch(conn, params))
            # A tick recorded before (two leaders overlapping) is read, committed, from here.
            return await self._resolve_created(conn, new, by_id)

    async def fire_ahead(
        self,
        lease: LeaderLease,
        new: Sequence[NewInstance],
        *,
        published: bool = False,
        planned: Mapping[str, int] | None = None,
    ) -> HeldFire | None:
        """As :meth:`fire`, written now in a transaction left open for the caller to commit
        at the tick (``FIRE_AHEAD``): the tick's instances become visible, and their messages
        can go out, a commit after the tick rather than a 1,000-row insert after it."""
        if not new:
            raise ValueError("a fire written ahead needs records")
        params = _fire_params(lease, new, published, planned)
        at = max(n.scheduled_at or datetime.min.replace(tzinfo=UTC) for n in new)
        stack = AsyncExitStack()  # (its close returns the connection even when cancelled)
        async with reachable():
            held = PostgresHeldFire(
                stack, await stack.enter_async_context(self.engine.connect()), at
            )
        try:
            async with reachable():
                # Bounded in its lock waits; the statement fences itself by the lease.
                await held.begin()
                found = await self._fire_ahead.fetch(held.conn, params)
            by_id = self._fire_result(lease, new, found)
            if len(by_id) < len(new):
                # Some tick recorded before (two leaders overlapping): not held, the fire at
                # its time reads it.
                raise StoreConflictError("a tick to write ahead is recorded already")
        except BaseException:
            await held.abandon()
            raise
        held.instances = [by_id[n.id] for n in new]
        return held

    def _fire_result(
        self, lease: LeaderLease, new: Sequence[NewInstance], result: list[dict[str, Any]]
    ) -> dict[UUID, Instance]:
        """The instances a fire's statement inserted, by id, or the error it reports."""
        if not result[0]["live"]:
            raise NotLeaderError(f"term {lease.term} of shard {lease.shard} is over")
        if result[0]["missing_key"] is not None:
            raise JobNotFoundError(result[0]["missing_key"])
        if result[0]["changed_keys"] is not None:
            raise DefinitionsChangedError(result[0]["changed_keys"])
        records = {n.id: n for n in new}
        return {
            row["id"]: rows.inserted_instance(records[row["id"]], row)
            for row in result
            if row["id"] is not None
        }

    @retry_conflicts
    async def create_published(self, new: NewInstance, definition: JobDefinition) -> Instance:
        params: dict[str, Any] = {
            "id": new.id,
            "job_key": new.job_key,
            "version": definition.version,
            # (no schema: JSON null, as the column stores it)
            "args_schema": json.dumps(definition.args_schema),
            "source": new.source.value,
            "queue": new.queue,
            "priority": new.priority,
            "args": None if new.args is None else json.dumps(new.args),
            "scheduled_at": new.scheduled_at,
            "run_at": new.run_at,
            "held": new.held,
            "pinned": new.pinned_worker,
            "retry_of": new.retry_of,
            "idempotency": new.idempotency_key,
            "fingerprint": fingerprint_of(new),
            "skip_reason": new.skip_reason,
            "actor": new.actor,
        }
        async with reachable():
            row = await self._create_one.run_row(self.engine, params)
        if row["id"] is not None:
            return rows.instance_from_row(row)
        if not row["checked"]:
            raise StaleDefinitionError(new.job_key, definition.version)
        # Not inserted at the checked version: its idempotency key was used before. The first
        # instance is committed (the insert waited for it), so this read finds it.
        async with reachable(), self.engine.connect() as conn:
            [instance] = await self._resolve_created(conn, [new], {})
        return instance

    async def _next_tokens(self, conn: AsyncConnection, count: int) -> list[int]:
        result = await conn.execute(
            text("SELECT nextval('claim_token_seq') FROM generate_series(1, :n)"), {"n": count}
        )
        return list(result.scalars())

    async def _renew(
        self, conn: AsyncConnection, leases: list[tuple[UUID, int]], lease_s: float
    ) -> dict[UUID, bool]:
        # One statement over arrays of ids and tokens (RENEW_SQL), not a list of pairs.
        result = await conn.execute(
            RENEW,
            {
                "ids": [instance_id for instance_id, _ in leases],
                "tokens": [token for _, token in leases],
                "lease": float(lease_s),
            },
        )
        return {r.id: r.cancel_requested for r in result}

    @retry_conflicts
    async def claim(
        self, ids: Sequence[UUID], worker_id: str, lease_s: float, jobs: Collection[str]
    ) -> ClaimResult:
        if not ids:
            return ClaimResult()
        # One statement, outside any transaction: it is its own (no BEGIN/COMMIT round trips
        # before a job can start); its row locks last until it ends, as before. On the driver
        # (DriverStatement), as the single trigger: the claim is on every job's path to start.
        async with reachable():
            found = await self._claim.run(
                self.engine,
                {
                    "ids": list(dict.fromkeys(ids)),
                    "jobs": list(jobs),
                    "worker": worker_id,
                    "lease": float(lease_s),
                    "limit_reason": EndReason.LIMIT_REACHED.value,
                    "cancel_reason": EndReason.CANCEL_BEFORE_CLAIM.value,
                },
            )
        claimed: list[Claim] = []
        skipped: list[UUID] = []
        waiting: list[UUID] = []
        cancelled: list[UUID] = []
        # Parsed once per job key, not once per row: the statement returns a job's options
        # with one of its claimed rows only.
        options = {
            row["job_key"]: JobOptions.from_stored(row["job_options"])
            for row in found
            if row["job_options"] is not None
        }
        others = {
            ClaimOutcome.SKIPPED: skipped,
            ClaimOutcome.WAITING: waiting,
            ClaimOutcome.CANCELLED: cancelled,
        }
        for row in found:
            outcome = ClaimOutcome(row["outcome"])
            if outcome is ClaimOutcome.CLAIMED:
                instance = rows.instance_from_row(row)
                claimed.append(Claim(instance=instance, options=options[instance.job_key]))
            else:
                others[outcome].append(row["id"])
        handled = {c.instance.id for c in claimed} | {*skipped, *waiting, *cancelled}
        return ClaimResult(
            claimed=claimed,
            skipped=skipped,
            waiting=waiting,
            cancelled=cancelled,
            ignored=[i for i in dict.fromkeys(ids) if i not in handled],
        )

    @retry_conflicts
    async def complete(self, outcomes: Sequence[Outcome]) -> dict[UUID, InstanceState]:
        if not outcomes:
            return {}
        for outcome in outcomes:
            check_transition(InstanceState.PROCESSING, outcome.state)
        params: dict[str, Any] = {
            "ids": [o.instance_id for o in outcomes],
            "tokens": [o.claim_token for o in outcomes],
            "states": [o.state.value for o in outcomes],
            "results": [json.dumps(o.result) for o in outcomes],
            "errors": [json.dumps(o.error.to_json()) if o.error else None for o in outcomes],
            "reasons": [o.reason for o in outcomes],
            "cancel_reason": EndReason.CANCEL_WINS,
            "holds": [o.holds_slot for o in outcomes],
        }
        if any(o.state is InstanceState.FAILED for o in outcomes):
            # A Failed outcome moves on (a retry, or Terminated) in the same transaction as
            # its recording: never left Failed by a crash in between.
            async with self._write() as conn:
                ended = await self._complete(conn, outcomes, params)
                failed = [o for o in outcomes if ended.get(o.instance_id) is InstanceState.FAILED]
                ended.update(await self._after_failure(conn, failed))
            return ended
        # Nothing follows the statement: outside any transaction it is its own. The slot rows
        # it locks are then held until its commit only, not over two more round trips (BEGIN,
        # COMMIT) and this process's turn to send the COMMIT, while claims of the same job key
        # wait on them. On the driver (DriverStatement), as the claim: a worker records every
        # job it runs, and at a few jobs a second each is its own statement.
        async with reachable():
            found = await self._complete_one.run(self.engine, params)
        return _ended(outcomes, [(row["id"], row["state"]) for row in found])

    async def _complete(
        self, conn: AsyncConnection, outcomes: Sequence[Outcome], params: dict[str, Any]
    ) -> dict[UUID, InstanceState]:
        result = await conn.execute(COMPLETE, params)
        return _ended(outcomes, [(row.id, row.state) for row in result])


def _ended(outcomes: Sequence[Outcome], found: list[tuple[UUID, str]]) -> dict[UUID, InstanceState]:
    """The states the outcome statement recorded, by instance; an outcome it did not record
    was fenced off (its claim token is no longer the instance's), and is logged."""
    ended = {instance_id: rows.state_of(state) for instance_id, state in found}
    for outcome in outcomes:
        if outcome.instance_id not in ended:
            log_fenced(outcome)
    return ended


def creation_params(new: Sequence[NewInstance]) -> dict[str, Any]:
    """The array parameters of ``CREATE`` and ``FIRE`` for ``new``, one array per column.

    A column that is NULL in every record is sent as an empty array: ``unnest`` pads a
    shorter array with NULLs, and the driver's encoding of an array costs the caller a few
    µs a value, before the statement reaches the server (a cron tick's records leave ten
    of the fifteen columns empty: docs/benchmarks.md, "Cron fire lag"). ``held`` is sent
    as true or NULL for the same reason (the statements read NULL as not held)."""
    columns: dict[str, list[Any]] = {
        "ids": [n.id for n in new],
        "job_keys": [n.job_key for n in new],
        "sources": [n.source.value for n in new],
        "queues": [n.queue for n in new],
        "priorities": [n.priority for n in new],
        "args": [None if n.args is None else json.dumps(n.args) for n in new],
        "scheduled_at": [n.scheduled_at for n in new],
        "run_at": [n.run_at for n in new],
        "held": [True if n.held else None for n in new],
        "pinned": [n.pinned_worker for n in new],
        "retry_of": [n.retry_of for n in new],
        "idempotency": [n.idempotency_key for n in new],
        "fingerprints": [fingerprint_of(n) for n in new],
        "skip_reasons": [n.skip_reason for n in new],
        "actors": [n.actor for n in new],
    }
    return {
        name: values if any(v is not None for v in values) else []
        for name, values in columns.items()
    }


def _fire_params(
    lease: LeaderLease,
    new: Sequence[NewInstance],
    published: bool,
    planned: Mapping[str, int] | None,
) -> dict[str, Any]:
    """The parameters of ``FIRE`` and ``FIRE_AHEAD``."""
    params = creation_params(new)
    params.update(shard=lease.shard, holder=lease.holder, term=lease.term)
    params["published"] = published
    params["planned_keys"] = list(planned or ())
    params["planned_versions"] = list((planned or {}).values())
    return params
