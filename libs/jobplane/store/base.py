"""Plumbing shared by the store modules: transactions, clocks, tokens, history records.

Writes run in :meth:`SqlBase._write` transactions. On Postgres the rows a write depends on are
locked (``FOR UPDATE``) and the hot paths are single statements (:mod:`jobplane.store.postgres`);
on SQLite every transaction is ``BEGIN IMMEDIATE``, so writes are serialised and the generic
statements cannot race.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
from collections.abc import AsyncIterator, Callable, Collection, Coroutine, Iterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any, ParamSpec, TypeVar

from sqlalchemy import (
    ColumnElement,
    Insert,
    func,
    literal,
    select,
    text,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError

from jobplane.domain.models import LeaderLease
from jobplane.domain.states import InstanceState
from jobplane.errors import NotLeaderError as NotLeaderError  # re-exported
from jobplane.errors import StoreConflictError as StoreConflictError  # re-exported
from jobplane.errors import StoreRefusedError, StoreUnavailableError, first_line
from jobplane.store import schema
from jobplane.store.engine import AsyncConnection, AsyncEngine
from jobplane.store.tables import counters, job_instances, scheduler_leases
from jobplane.tasks import being_cancelled

logger = logging.getLogger("jobplane.store")


#: SQLSTATEs of a transaction rolled back because of a concurrent one: deadlock detected,
#: serialization failure, lock not available (``lock_timeout``), and a statement cancelled by
#: ``statement_timeout`` (the session limits every role sets): nothing of it was written.
CONFLICT_SQLSTATES = frozenset({"40P01", "40001", "55P03", "57014"})
#: Tries of a transaction that lost to a concurrent one (the first included).
CONFLICT_TRIES = 5

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

#: Values bound in one ``IN (…)`` at most: a statement takes at most 32,767 parameters
#: (asyncpg; SQLite 32,766), and a list the caller makes (every active recurring job, every
#: instance of a batch) may be longer.
BIND_SLICE = 10_000


def in_slices(values: Collection[T], size: int = BIND_SLICE) -> Iterator[list[T]]:
    """``values`` in lists of at most ``size``, in their order (none for none)."""
    listed = list(values)
    for start in range(0, len(listed), size):
        yield listed[start : start + size]


def retry_conflicts(
    method: Callable[P, Coroutine[Any, Any, R]],
) -> Callable[P, Coroutine[Any, Any, R]]:
    """Run a store method (one transaction) again when it lost to a concurrent transaction,
    up to :data:`CONFLICT_TRIES` times with a short random pause, logging each retry. Only
    for methods that open their own transaction: the rolled-back one wrote nothing, so the
    retry is the first write."""

    @functools.wraps(method)
    async def retried(*args: P.args, **kwargs: P.kwargs) -> R:
        for attempt in range(1, CONFLICT_TRIES + 1):
            try:
                return await method(*args, **kwargs)
            except StoreConflictError as exc:
                if attempt == CONFLICT_TRIES:
                    raise
                pause = random.uniform(0.005, 0.05) * attempt  # jitter only
                logger.warning(
                    "%s: %s; try %d of %d, retrying in %.0f ms",
                    method.__name__,
                    exc,
                    attempt,
                    CONFLICT_TRIES,
                    pause * 1000,
                    extra={"action": "store.conflict_retry"},
                )
                await asyncio.sleep(pause)
        raise AssertionError("unreachable")  # pragma: no cover

    return retried


class SqlBase:
    """Owns ``engine`` and disposes of it in :meth:`close`."""

    #: See :attr:`jobplane.store.abc.StoreConnection.concurrent_reads`: SQLite's reads are
    #: ``BEGIN IMMEDIATE`` transactions too, so they queue on the file's lock.
    concurrent_reads = False

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def close(self) -> None:
        await self.engine.dispose()

    @asynccontextmanager
    async def _write(self) -> AsyncIterator[AsyncConnection]:
        """A write transaction; driver errors that mean "unreachable" become
        :class:`StoreUnavailableError`."""
        async with reachable(), self.engine.begin() as conn:
            yield conn

    _read = _write

    async def notifications(self, channel: str) -> AsyncIterator[list[str]]:
        """Batches of payloads notified on ``channel`` by committed transactions. This store
        has none (see the subclasses'): it ends at once, and the sweep is what finds the work."""
        for _ in ():
            yield []

    async def ping(self) -> None:
        async with self._read() as conn:
            await conn.execute(select(literal(1)))

    async def schema_revision(self) -> str | None:
        """The schema revision the database is at (``None``: never migrated). A connection
        lost on the way is :class:`StoreUnavailableError`, as for every other read: a role
        starting on a loaded machine can outlive its session's idle-in-transaction limit
        between the two reads, and must wait that out, not exit."""
        async with reachable():
            return await schema.current_revision(self.engine)

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

    async def _fence(self, conn: AsyncConnection, lease: LeaderLease | None) -> None:
        """Fence a leader write: share-lock the live lease row of its term. A takeover must
        update that row, so it waits until this transaction commits; a deposed leader (lease
        expired or taken, e.g. after a SIGSTOP) finds no live row and writes nothing."""
        if lease is None:
            return
        live = (
            await conn.execute(
                select(scheduler_leases.c.term)
                .where(
                    scheduler_leases.c.shard == lease.shard,
                    scheduler_leases.c.holder == lease.holder,
                    scheduler_leases.c.term == lease.term,
                    scheduler_leases.c.expires_at > self._clock(),
                )
                .with_for_update(read=True)
            )
        ).first()
        if live is None:
            raise NotLeaderError(f"term {lease.term} of shard {lease.shard} is over")


def unindexed_state(columns: Any, *states: InstanceState) -> ColumnElement[bool]:
    """``state`` is one of ``states``, written as an expression no index matches
    (``state || ''``), for a statement that names its instances by id: they are then found by
    primary key, never by reading every row in that state through an index on the state (the
    rule, and what it cost, at the top of :mod:`jobplane.store.postgres_sql`)."""
    state: ColumnElement[str] = columns.state.concat("")
    if len(states) == 1:
        return state == states[0].value
    return state.in_([s.value for s in states])


async def plan_for_these_ids(conn: AsyncConnection) -> None:
    """Plan the rest of this transaction's statements for their own values each time, never
    from a cached generic plan (Postgres; a no-op elsewhere). For a statement that names a
    list of instances by id: prepared once per list length, after five runs Postgres may keep
    a generic plan made with the table's size of that moment, and once a burst has grown a
    table analyzed small it read every row and compared each with every id of the list (the
    ids are parameters, not a constant array, so they are not hashed). A custom plan sees the
    table's current size and a constant list: a primary-key lookup per id. Costs one round
    trip and a planning per run: for the publication marks, whose generic plans went wrong
    (docs/benchmarks.md, "Cached generic plans"). The lease renewals, checked the same way,
    kept a flat cost under generic plans, and planning their list of 512 pairs each time
    cost more (43 against 30 ms); on Postgres they are now one statement over arrays
    (``RENEW_SQL``), planned once."""
    if conn.dialect.name == "postgresql":
        await conn.execute(text("SET LOCAL plan_cache_mode = force_custom_plan"))


def locked_in_id_order(
    where: Callable[[Any], ColumnElement[bool]], *, skip_locked: bool = False
) -> ColumnElement[bool]:
    """``id IN (...)`` over the instances ``where(columns)`` selects, locked in id order first
    (Postgres; SQLite serialises writes). An UPDATE of several instances locks them in the
    order its plan meets them; statements that lock the same rows in different orders
    deadlock. Every multi-row instance write therefore goes through this, or locks in id order
    itself (the claim). With ``skip_locked`` a row another transaction holds is left out."""
    locked = job_instances.alias("locked")
    return job_instances.c.id.in_(
        select(locked.c.id)
        .where(where(locked.c))
        .order_by(locked.c.id)
        .with_for_update(skip_locked=skip_locked)
    )


def _aware(value: datetime | str) -> datetime:
    if isinstance(value, str):  # SQLite returns CURRENT_TIMESTAMP-style strings
        value = datetime.fromisoformat(value)
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


#: SQLSTATEs of a server that cannot run any write, or anything, for now, whatever the
#: statement: a lost connection (class 08), shutting down or starting up (57P0x), read-only (a
#: standby, or ``default_transaction_read_only`` for maintenance: 25006), out of resources
#: (disk full, out of memory, too many connections: class 53), a system error (class 58).
#: Waited out and retried like a lost connection; taken for a refusal of the statement's data,
#: the sweeps and the fire skipped their work and the lease renewal ended the scheduler.
UNAVAILABLE_SQLSTATES = ("08", "57P0", "25006", "53", "58")
_DISCONNECT_NAMES = frozenset(
    {
        "ConnectionDoesNotExistError",
        "CannotConnectNowError",
        "ConnectionFailureError",
        "AdminShutdownError",
        "InterfaceError",
    }
)


@asynccontextmanager
async def reachable() -> AsyncIterator[None]:
    """Driver errors raised inside become the store's: a lost or refused connection
    :class:`StoreUnavailableError` (waited out, retried), a transaction that lost to another
    :class:`StoreConflictError`, any other refusal :class:`StoreRefusedError`."""
    try:
        yield
    except (DBAPIError, OSError) as exc:
        if isinstance(exc, DBAPIError) and _sqlstate(exc) in CONFLICT_SQLSTATES:
            if being_cancelled():
                raise asyncio.CancelledError from exc
            raise StoreConflictError(f"transaction conflict: {first_line(exc)}") from exc
        # (a bare DBAPIError too: asyncpg's "the database system is shutting down" while
        # connecting is neither an OperationalError nor an InterfaceError)
        if isinstance(exc, DBAPIError) and not _is_disconnect(exc):
            # Translated here, at the store's edge: the roles never see the driver's errors.
            raise StoreRefusedError(first_line(exc), _sqlstate(exc)) from exc
        if being_cancelled():
            raise asyncio.CancelledError from exc  # the cancel, as the driver reported it
        raise StoreUnavailableError(f"metadata store unavailable: {first_line(exc)}") from exc


def _is_disconnect(exc: DBAPIError) -> bool:
    """Whether a driver error means "cannot reach the database" (not a bad statement)."""
    orig = exc.orig
    if exc.connection_invalidated or isinstance(orig, OSError):
        return True
    cause = getattr(orig, "__cause__", None)
    if type(orig).__name__ in _DISCONNECT_NAMES or type(cause).__name__ in _DISCONNECT_NAMES:
        return True
    if _sqlstate(exc).startswith(UNAVAILABLE_SQLSTATES):
        return True
    # SQLite: the file could not be opened, or another connection (the application's own
    # transaction around enqueue(), a shell, a VACUUM) held its lock past the busy timeout.
    # Taken for a refusal of the data, an outcome was recorded as not stored (a success
    # became a failure) and the heartbeat and the leader's campaign ended their roles.
    return any(text in str(orig) for text in _SQLITE_UNAVAILABLE)


_SQLITE_UNAVAILABLE = (
    "unable to open database",
    "database is locked",
    "database table is locked",
)


def _sqlstate(exc: DBAPIError) -> str:
    orig = exc.orig
    cause = getattr(orig, "__cause__", None)
    return str(getattr(orig, "sqlstate", None) or getattr(cause, "sqlstate", None) or "")
