"""The embedded default: a SQLite file. Every transaction is ``BEGIN IMMEDIATE``, so writes are
serialised and the generic statements of :class:`SqlStore` cannot race."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import ColumnElement, event, literal
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.pool import ConnectionPoolEntry

from jobplane.errors import ConfigurationError, StoreUnavailableError
from jobplane.store.creation import DUE_PREFIX, ENQUEUED_CHANNEL
from jobplane.store.engine import AsyncConnection, AsyncEngine, create_async_engine
from jobplane.store.sql import SqlStore
from jobplane.store.types import UtcDateTime

BUSY_TIMEOUT_MS = 30_000

logger = logging.getLogger("jobplane.store")

#: The SQL function the connection-local triggers call with the ``run_at`` of each row made
#: Scheduled, and the triggers: ``TEMP``, they live and die with the connection that made
#: them, so the file's schema has none (another program writing the file, such as the
#: application's own transaction around ``enqueue()``, writes without them).
DUE_FUNCTION = "jobplane_due"
_DUE_TRIGGERS = [
    f"""CREATE TEMP TRIGGER IF NOT EXISTS jobplane_due_{operation}
    AFTER {operation.upper()}{columns} ON main.job_instances
    FOR EACH ROW WHEN NEW.state = 'scheduled' AND NEW.run_at IS NOT NULL
    BEGIN SELECT {DUE_FUNCTION}(NEW.run_at); END"""
    for operation, columns in (("insert", ""), ("update", " OF state, run_at"))
]
#: Where a connection's record keeps the announcements of its open transaction, and whether
#: its triggers are in place.
_PENDING, _INSTALLED = "jobplane_due_pending", "jobplane_due_installed"


class SqliteStore(SqlStore):
    """The generic store on a SQLite file, with in-process notifications.

    SQLite has no ``NOTIFY``. An instance made Scheduled (a short delay, a retry's backoff) is
    announced on :data:`ENQUEUED_CHANNEL` as on Postgres (migration 0023), by triggers local
    to each of this store's connections, as its transaction commits; :meth:`notifications`
    hands the announcements to this store's listeners. So the embedded default (``jobplane
    dev``: every role on one store) wakes its leader at the instance's ``run_at``, not at the
    next sweep. A role in another process on the same file, or an ``enqueue()`` in the
    application's own transaction, is not heard: the sweep finds those instances, up to one
    interval late. The store owns its engine (one store per engine)."""

    def __init__(self, engine: AsyncEngine) -> None:
        super().__init__(engine)
        #: This process's transactions on the file, one after another, in the order asked
        #: for (``asyncio.Lock`` is first come, first served). Every transaction here takes
        #: the file's write lock at its start (BEGIN IMMEDIATE), and SQLite makes a
        #: connection that finds it taken sleep and try again (1 ms, then longer, up to
        #: 100 ms): while a worker wrote without pause, the leader's lease renewal, trying at
        #: those moments, found the lock taken each time for seconds (6.04 s once), long
        #: enough to lose its term, and a transaction slept on after the lock was free.
        #: Queued here, each starts as the one before it ends. (A connection that is not the
        #: store's, such as the application's transaction around ``enqueue()`` or the schema
        #: check at start, and another process on the same file, still meet the file's lock
        #: and its busy timeout. The lock belongs to the event loop that first uses it, as
        #: the engine's connections do.)
        self._turns = asyncio.Lock()
        #: Transactions waiting for their turn (see _take_turn).
        self._queued = 0
        self._listeners: dict[str, set[asyncio.Queue[str]]] = {}
        sync_engine = engine.sync_engine
        event.listen(sync_engine, "connect", _install_function)
        event.listen(sync_engine, "checkout", _install_triggers)
        event.listen(sync_engine, "commit", self._committed)
        event.listen(sync_engine, "rollback", _rolled_back)

    def _clock(self) -> ColumnElement[datetime]:
        # One process owns the file, so its clock is the store's clock; CURRENT_TIMESTAMP
        # would only have second precision.
        return literal(datetime.now(UTC), UtcDateTime)

    # The same clock, read without a statement: selecting it cost a round trip to the
    # driver's thread (four hand-overs between threads) in every write that reads the clock,
    # and, outside a transaction, the file's write lock (every transaction here is
    # BEGIN IMMEDIATE) just to read this process's time.
    async def now(self) -> datetime:
        return datetime.now(UTC)

    async def _now(self, conn: AsyncConnection) -> datetime:
        return datetime.now(UTC)

    @asynccontextmanager
    async def _write(self) -> AsyncIterator[AsyncConnection]:
        await self._take_turn()
        try:
            async with super()._write() as conn:
                yield conn
        finally:
            self._turns.release()

    async def _take_turn(self) -> None:
        """This transaction's turn, waited for at most the busy timeout: while another
        connection holds the file's lock, each transaction ahead waits that long in its
        BEGIN, and an API request queued behind a role's few waited out each one in turn (148
        s for a lock of 150 s) before its own. It is an outage after the busy timeout, as its
        own BEGIN would be (so an answer within twice the timeout, a 503 from the API)."""
        if not self._turns.locked() and not self._queued:
            await self._turns.acquire()  # free, nobody waiting: taken at once, no timer
            return
        # (Just after a release the lock reads free while the waiter it woke has not run:
        # one taking the fast path then would queue behind everyone, with no bound.)
        self._queued += 1
        try:
            await asyncio.wait_for(self._turns.acquire(), BUSY_TIMEOUT_MS / 1000)
        except TimeoutError:
            raise StoreUnavailableError(
                f"database is locked: the transactions ahead of this one waited "
                f"{BUSY_TIMEOUT_MS / 1000:g} s for the file"
            ) from None
        finally:
            self._queued -= 1

    _read = _write

    async def notifications(self, channel: str) -> AsyncIterator[list[str]]:
        """Batches of what this process's transactions on this store announced on
        ``channel``, as they commit (see the class)."""
        queue: asyncio.Queue[str] = asyncio.Queue()
        self._listeners.setdefault(channel, set()).add(queue)
        try:
            while True:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                yield batch
        finally:
            self._listeners[channel].discard(queue)

    def _committed(self, conn: Connection) -> None:
        """Hand the committing transaction's announcements to the listeners. (The event comes
        just before the commit itself: a listener that reads at once takes the file's lock
        after this transaction's, so it finds the rows. One that wakes for a commit that then
        fails, or for a row a rolled-back savepoint wrote, finds nothing due: a read lost.)"""
        pending = _pending(conn)
        if not pending:
            return
        # Once per distinct time, as Postgres delivers a transaction's identical NOTIFYs once:
        # a batch of 1,000 delayed alike wakes the leader once.
        payloads = [f"{DUE_PREFIX}{p}" for p in dict.fromkeys(pending)]
        pending.clear()
        for queue in self._listeners.get(ENQUEUED_CHANNEL, ()):
            for payload in payloads:
                queue.put_nowait(payload)


def _install_function(dbapi_connection: Any, record: ConnectionPoolEntry) -> None:
    """Give a new connection the function its triggers call, which keeps each ``run_at``
    (epoch seconds) for the commit."""
    pending: list[str] = []
    record.info[_PENDING] = pending

    def due(run_at: str | None) -> None:
        # Called by SQLite, in the driver's thread, for each row made Scheduled. An error
        # raised here would fail the write it announces, so none may leave: a value it
        # cannot read is logged and left to the sweep.
        try:
            epoch = datetime.fromisoformat(str(run_at)).replace(tzinfo=UTC).timestamp()
        except Exception:
            logger.warning(
                "could not read the run_at %r of an instance made Scheduled; the sweep finds it",
                run_at,
                exc_info=True,
                extra={"action": "store.due_unreadable"},
            )
            return
        pending.append(repr(epoch))

    dbapi_connection.create_function(DUE_FUNCTION, 1, due)


def _install_triggers(dbapi_connection: Any, record: ConnectionPoolEntry, _proxy: Any) -> None:
    """Create a connection's triggers at its first checkout once the instance table exists
    (a connection opened before the schema was migrated gets them at a later checkout). A
    failure here must not fail the checkout (and the call that needed the connection): it is
    logged, and tried again at the next one."""
    if record.info.get(_INSTALLED):
        return
    try:
        if _PENDING not in record.info:
            # Opened before this store listened for new connections: without the function,
            # its triggers would fail every write they fire on.
            _install_function(dbapi_connection, record)
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(
                "SELECT 1 FROM main.sqlite_master WHERE type = 'table' AND name = 'job_instances'"
            )
            if cursor.fetchone() is None:
                return
            for statement in _DUE_TRIGGERS:
                cursor.execute(statement)
        finally:
            cursor.close()
    except Exception as exc:
        logger.warning(
            "could not give a connection its due-time triggers (%s); tried again at its next "
            "checkout, and the sweep finds what it writes meanwhile",
            exc,
            extra={"action": "store.due_triggers_failed"},
        )
        return
    record.info[_INSTALLED] = True


def _rolled_back(conn: Connection) -> None:
    """A transaction rolled back announces nothing."""
    pending = _pending(conn)
    if pending:
        pending.clear()


def _pending(conn: Connection) -> list[str] | None:
    """The announcements kept on ``conn``'s DBAPI connection, if it still has one. (An
    invalidated one, a statement cancelled mid-way, is gone with what it kept: its
    ``info`` would raise, and the one that replaces it starts with nothing kept.)"""
    if conn.invalidated or conn.closed:
        return None
    found: list[str] | None = conn.info.get(_PENDING)
    return found


class _RollbackOnClose(sqlite3.Connection):
    """A connection that ends its transaction before it closes.

    SQLAlchemy closes a connection whose statement was cancelled (a task cancelled mid-query:
    a stopping role). If a cursor of it is still alive, ``sqlite3_close_v2`` only makes it a
    zombie, which keeps its open transaction - and the file's write lock - until that cursor
    is collected: every other connection's ``BEGIN IMMEDIATE`` then waits out the busy
    timeout. Rolling back first releases the lock whatever still refers to the connection.
    """

    def close(self) -> None:
        try:
            if self.in_transaction:
                self.rollback()
        finally:
            super().close()


def sqlite_engine(url: str, **kwargs: Any) -> AsyncEngine:
    parsed = make_url(url)
    if parsed.database in (None, "", ":memory:") or parsed.query.get("mode") == "memory":
        # Each connection would open a database of its own, empty: `jobplane migrate` (and
        # `jobplane dev`'s own migration) migrated one and the roles found another, waited out
        # the start-up timeout and then said to run `jobplane migrate`.
        raise ConfigurationError(
            f"{url!r} is an in-memory SQLite database, which lives only as long as its "
            "connections and is not shared between processes (nor with `jobplane migrate`): "
            "use a file, e.g. sqlite:///jobplane.db"
        )
    kwargs.setdefault("connect_args", {})["factory"] = _RollbackOnClose
    engine = create_async_engine(url, **kwargs)

    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy's "begin" event issue BEGIN itself (pysqlite would defer it).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        cursor.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(conn: Any) -> None:
        # Take the write lock up front: a read-then-write transaction can never be overtaken.
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine
