"""The leader's cron fire on Postgres: one statement at the tick (``FIRE``), or written ahead
of it in a transaction committed at the tick (``FIRE_AHEAD``: ``store/ahead.py``). Built on
the batch creation of ``postgres_sql``."""

from __future__ import annotations

from sqlalchemy import ARRAY, text

from jobplane.store.postgres_sql import (
    _CREATE_INPUT,
    _PUBLISHED,
    _STATE,
    DECIDED_COLUMNS,
    _create_insert,
)
from jobplane.store.tables import job_instances

# The leader's cron fire: the batch creation of ``postgres_sql``, fenced and checked in the same
# statement, run in autocommit (one round trip: no BEGIN, no separate fence and key reads, no
# COMMIT).
# The races it closes, besides those of the creation:
# - a deposed leader (lease expired or taken over, e.g. after a SIGSTOP): ``fence`` share-locks
#   the live lease row of its term before any row is inserted (``resolved`` is gated on it, a
#   one-time filter evaluated first). A takeover must update that row, so it waits until this
#   statement has committed; one that committed first leaves no live row, and nothing is
#   written (``live`` false: the caller raises NotLeaderError);
# - a job deleted since the leader read it: nothing of the batch is written and the first
#   missing key comes back (``missing_key``: the caller raises JobNotFoundError), as the
#   transaction of separate statements did;
# - a job edited, paused or resumed since the leader planned its tick (its event or its
#   pending-update mark still in flight, or lost with a Redis restart): with the versions the
#   leader planned under (``planned``), nothing of the batch is written and the jobs whose
#   stored version differs come back (``changed_keys``: the caller raises
#   DefinitionsChangedError, re-plans them and fires the rest). An edit committed before the
#   statement began is in its snapshot, so no tick fires on options replaced before it;
# - two leaders firing one tick (overlap at a failover): the unique index on (job, occurrence)
#   inserts it once; the caller reads the existing one. It is named as the one arbiter: a fire
#   writes cron records only (fresh ids, no idempotency key), so it is the only duplicate a
#   fire can meet, and the insert skips the speculative checks of the other unique indexes
#   (a 1,000-row tick's insert p50 36.8 → 33.5 ms; docs/benchmarks.md, "Cron fire lag").
# With ``published``, an Enqueued instance is recorded as published in its row, as
# ``CREATE_ONE`` does: the caller sends it at once, and clears the mark if the send fails.
# The single row always comes back with the flags: the instance columns are NULL when nothing
# was inserted.
#: The unique index of cron occurrences, as an ``ON CONFLICT`` arbiter.
_OCCURRENCE = "(job_key, scheduled_at) WHERE source = 'cron'"


def _fire_sql(ahead: bool) -> str:
    """The fire's statement; ``ahead``: written before its tick, in a transaction committed at
    the tick (``FIRE_AHEAD``)."""
    # Ahead of the tick the statement's snapshot is older than the tick: an edit or a pause
    # committed between the two would go unseen. So the planned jobs' definition rows are
    # share-locked (in key order) and their versions compared as locked, which is the latest
    # committed version (Read Committed re-reads a row updated since the snapshot when it
    # locks it): an edit committed before the lock is seen and refuses the fire; one that
    # comes after waits for the tick's commit, and so comes after the tick.
    definitions = (
        """locked AS MATERIALIZED (
    SELECT d.key, d.version FROM job_definitions d
    WHERE d.key = ANY (CAST(:planned_keys AS text[]))
    ORDER BY d.key
    FOR SHARE
),"""
        if ahead
        else ""
    )
    compared = "locked" if ahead else "job_definitions"
    # Its instances come into being at the commit, at the tick: their creation time and
    # record say the tick (the clock's time when written late, as a fire at its time does).
    at = "GREATEST(clock_timestamp(), r.scheduled_at)" if ahead else "clock_timestamp()"
    created = "GREATEST(now(), scheduled_at)" if ahead else "now()"
    # (and its message is sent then: the republish sweep counts from there)
    published = _PUBLISHED.replace("now()", created)
    return f"""
WITH fence AS MATERIALIZED (
    SELECT term FROM scheduler_leases
    WHERE shard = :shard AND holder = :holder AND term = :term AND expires_at > now()
    FOR SHARE
),
{_CREATE_INPUT},
missing AS MATERIALIZED (
    SELECT min(t.job_key) AS job_key FROM input t
    WHERE NOT EXISTS (SELECT 1 FROM job_definitions d WHERE d.key = t.job_key)
),
planned AS (
    SELECT * FROM unnest(CAST(:planned_keys AS text[]), CAST(:planned_versions AS integer[]))
        AS p(job_key, version)
),
{definitions}
changed AS MATERIALIZED (
    SELECT array_agg(p.job_key ORDER BY p.job_key) AS job_keys
    FROM planned p JOIN {compared} d ON d.key = p.job_key
    WHERE d.version <> p.version
),
resolved AS (
    SELECT t.*, d.options,
           {_STATE}
    FROM input t JOIN job_definitions d ON d.key = t.job_key
    WHERE EXISTS (SELECT 1 FROM fence) AND (SELECT job_key FROM missing) IS NULL
      AND (SELECT job_keys FROM changed) IS NULL
),
{_create_insert(published, _OCCURRENCE, ", ".join(DECIDED_COLUMNS), at, created)}
SELECT ins.*, EXISTS (SELECT 1 FROM fence) AS live, (SELECT job_key FROM missing) AS missing_key,
       (SELECT job_keys FROM changed) AS changed_keys
FROM (SELECT 1) AS one LEFT JOIN ins ON true
"""


FIRE_SQL = _fire_sql(ahead=False)
FIRE_AHEAD_SQL = _fire_sql(ahead=True)


# Built once: SQLAlchemy then compiles each of them once per process, not once per call.
_FIRE_COLUMNS = dict(
    live=job_instances.c.cancel_requested.type,
    missing_key=job_instances.c.job_key.type,
    changed_keys=ARRAY(job_instances.c.job_key.type),
)
FIRE = text(FIRE_SQL).columns(*(job_instances.c[name] for name in DECIDED_COLUMNS), **_FIRE_COLUMNS)
FIRE_AHEAD = text(FIRE_AHEAD_SQL).columns(
    *(job_instances.c[name] for name in DECIDED_COLUMNS), **_FIRE_COLUMNS
)
