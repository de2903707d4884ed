"""A cron tick written ahead of its time, committed at it (Postgres).

The leader writes a tick's instances (a 1,000-row insert with its history: tens of ms) a
moment before the tick, in a transaction it leaves open, and commits it at the tick: the
instances become visible, and their messages go out, a commit after the tick. Until then
nobody sees them, and what the transaction locks keeps its facts true at the commit:

- the live lease row of the leader's term, share-locked: nothing can take the term over
  while the tick is held but by ending the held session first (below), which rolls it back;
- the planned jobs' definition rows, share-locked: an edit or a pause of one of them waits
  for the commit, so it comes after the tick, as it would have come after a fire at its time;
- the unique occurrence of each (job, tick): a second leader's fire of it waits, then skips it;
- the instance-count rows of its jobs' Enqueued instances, on a shard of the counts no other
  session writes (:data:`COUNT_SHARD`, migration 0024): a claim of one of those jobs' earlier
  instances, which moves the counts on its own session's shard, does not wait for the tick.

A takeover does not wait for a frozen leader's tick: the lease has expired by then, and the
standby ends the sessions the expired holder still holds its lease row with (the held one
among them), which rolls the tick back; the new leader fires it. The leader's own renewal of
its lease waits for the commit.

The write itself waits for no lock longer than ``LOCK_TIMEOUT_MS`` (an edit of one of its jobs
under way, say): it is given up, and the tick is fired at its time.

The open transaction is bounded by the role's ``idle_in_transaction_session_timeout``: a
leader that froze before its commit has its session ended by the server, which rolls the
tick back, and whoever leads then fires it.
"""

from __future__ import annotations

import contextlib
import logging
from contextlib import AsyncExitStack
from datetime import UTC, datetime

from jobplane.domain.models import Instance
from jobplane.errors import first_line
from jobplane.store.base import reachable
from jobplane.store.driver import run_script
from jobplane.store.engine import AsyncConnection, run_to_completion

logger = logging.getLogger(__name__)

#: The longest a tick's write ahead waits for a lock (``SET LOCAL lock_timeout``): the leader
#: writes it while planning, and a writer's transaction left open must not hold that up.
LOCK_TIMEOUT_MS = 50


#: The shard of the instance counts a held tick writes (migration 0024): the sessions' own are
#: their pids modulo 16, so the counter rows the tick keeps locked until its commit are rows no
#: claim or outcome writes.
COUNT_SHARD = 16

#: Begins the held transaction (on the driver: SQLAlchemy does not see it).
BEGIN = (
    f"BEGIN; SET LOCAL lock_timeout = {LOCK_TIMEOUT_MS};"
    f" SET LOCAL jobplane.count_shard = {COUNT_SHARD}"
)


def commit_at(at: datetime, within_s: float) -> str:
    """Waits until the database's clock has reached the tick ``at``, then commits unless that
    clock is more than ``within_s`` past it (the leader stalled, or its reading of the clock
    was held up: it believed itself on time), in one round trip. The leader wakes for the
    tick on its own clock, set from the database's, but only the database's decides: no tick
    is committed before its time, by any fraction, nor recorded as on time when it was not
    (a tick written ahead records the tick itself). Late, it raises (SQLSTATE ``P0001``) and
    the transaction is rolled back."""
    tick = f"TIMESTAMPTZ '{at.astimezone(UTC).isoformat()}'"
    return f"""DO $$ BEGIN
    PERFORM pg_sleep(GREATEST(0, extract(epoch FROM {tick} - clock_timestamp())));
    IF clock_timestamp() > {tick} + make_interval(secs => {float(within_s)!r}) THEN
        RAISE EXCEPTION 'the tick of % was reached late, at %', {tick}, clock_timestamp();
    END IF;
END $$; COMMIT"""


class PostgresHeldFire:
    """A fire's transaction left open (see :meth:`~jobplane.store.abc.LeaderStore.fire_ahead`),
    to be committed once the database's clock reads ``at``. The transaction is run on the
    driver, begun by :data:`BEGIN` before the fire's statement: its commit then carries the
    wait for the tick in the same round trip."""

    def __init__(self, stack: AsyncExitStack, conn: AsyncConnection, at: datetime) -> None:
        self._stack = stack
        #: The connection it holds (the fire's statement runs on it).
        self.conn = conn
        self._at = at
        self._open = False
        #: The instances as the statement wrote them.
        self.instances: list[Instance] = []

    async def begin(self) -> None:
        # (Open from before it is sent: whatever it raises, the release rolls back, and a
        # ROLLBACK with no transaction only warns.)
        self._open = True
        await run_script(self.conn, BEGIN)

    async def commit(self, within_s: float) -> list[Instance]:
        """Commit the fire, not before its tick on the database's clock, nor more than
        ``within_s`` after it (:func:`commit_at`): its instances exist from then on. Raises
        the store's errors (late: ``StoreRefusedError``, nothing recorded); the fire is then
        unknown (the commit may have happened before the connection broke): a fire of the
        same records again finds what was recorded."""
        try:
            async with reachable():
                await run_script(self.conn, commit_at(self._at, within_s))
            self._open = False
        finally:
            await self.abandon()
        return self.instances

    async def abandon(self) -> None:
        """Roll the fire back (unless committed) and give the connection back to the pool;
        no-op the second time. It runs to its end even if the caller is cancelled, and never
        raises otherwise: a session the server already ended (a restart, the idle limit, a
        takeover ending a frozen leader's) rolled the fire back itself, and its connection
        is discarded."""
        await run_to_completion(self._release())

    async def _release(self) -> None:
        if self._open and self.conn.sync_connection.invalidated:
            # Broken and discarded already (its transaction ended with it): a ROLLBACK would
            # only check a new connection out, waiting for an unreachable server.
            self._open = False
        if self._open:
            self._open = False
            try:
                async with reachable():
                    await run_script(self.conn, "ROLLBACK")
            except Exception as exc:  # (not CancelledError)
                # Never back to the pool with the transaction maybe still open.
                logger.info("a held fire's session was already gone: %s", first_line(exc))
                with contextlib.suppress(Exception):
                    await self.conn.invalidate()
        await release(self._stack)


async def release(stack: AsyncExitStack) -> None:
    """Close ``stack`` (a held fire's connection), logging rather than raising what the
    rollback of a dead session raises."""
    try:
        async with reachable():
            await stack.aclose()
    except Exception as exc:  # (not CancelledError)
        logger.info("a held fire's session was already gone: %s", first_line(exc))
