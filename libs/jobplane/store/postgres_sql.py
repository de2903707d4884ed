"""The Postgres store's hand-written statements: each one round trip, each commented with the
races it closes. Built once per process (SQLAlchemy then compiles each of them once)."""

from __future__ import annotations

from sqlalchemy import text

from jobplane.domain.models import ClaimOutcome
from jobplane.store.tables import job_instances

_COLUMNS = ", ".join(f"{{t}}.{c.name}" for c in job_instances.c)


def _cols(alias: str) -> str:
    return _COLUMNS.format(t=alias)


# Instances named by id are found by primary key only: a statement that names its rows (a
# claim's batch, a batch of outcomes) writes its conditions on the state and the job key as
# expressions no index matches (``state || ''``). Otherwise, whenever the planner's statistics
# do not know how many rows are in that state (a new table; a burst since the last ANALYZE,
# which saw Enqueued and Processing rows as rare), it reads them through an index on the state
# (or on a job's Enqueued rows) and filters by id, and each such statement costs every row in
# that state, and every index entry left by the rows that passed through it since the last
# vacuum (docs/benchmarks.md, "Statements that name instances by id: their plans").
# ``jobplane.store.base.unindexed_state`` is the same rule for the statements built with
# SQLAlchemy.

# One statement claims a batch. The races it closes:
# - duplicate messages / racing workers: ``cand`` locks the Enqueued rows (in id order, so two
#   claimers never deadlock) and re-checks their state after any wait, so one instance is
#   claimed once;
# - the concurrency limit: ``slots`` locks the job's counter row; after a wait it reads the
#   latest ``used``, and the claim adds to it in the same statement (``rn <= free``), so
#   ``used <= max_concurrency`` holds whatever the number of claimers;
# - history: written by the same statement, after the slot lock, so the history sequence
#   orders claims and releases of one job key the way they really happened;
# - a cancel requested while an attempt ran that was then released (shutdown): ``cand`` reads
#   ``cancel_requested`` from the locked row, and such a row is never claimed: ``cancelled``
#   ends it in this statement (a cancel request waits on the lock and sees it Cancelled).
# The columns it writes are those of ``jobplane.domain.transitions.EFFECTS`` for Enqueued →
# Processing, Skipped and Cancelled; ``tests/test_transitions.py`` runs it and checks them.
CLAIM_SQL = f"""
WITH cand AS MATERIALIZED (
    SELECT id, job_key, priority, cancel_requested
    FROM job_instances
    WHERE id = ANY(CAST(:ids AS uuid[]))
      -- by primary key only (see above): not the backlog, through ix_job_instances_unpublished
      AND (state || '') = 'enqueued'
      AND (job_key || '') = ANY(CAST(:jobs AS text[]))
      AND (pinned_worker IS NULL OR pinned_worker = :worker)
    ORDER BY id
    FOR UPDATE
),
slots AS MATERIALIZED (
    SELECT s.job_key, d.max_concurrency - s.used AS free, d.options ->> 'on_limit' AS on_limit
    FROM job_slots s JOIN job_definitions d ON d.key = s.job_key
    WHERE s.job_key IN (SELECT job_key FROM cand)
    ORDER BY s.job_key
    FOR UPDATE OF s
),
ranked AS (
    SELECT c.id, c.job_key, s.free, s.on_limit,
           row_number() OVER (PARTITION BY c.job_key ORDER BY c.priority DESC, c.id) AS rn
    FROM cand c JOIN slots s ON s.job_key = c.job_key
    WHERE NOT c.cancel_requested
),
cancelled AS (
    UPDATE job_instances i
    SET state = 'cancelled', finished_at = clock_timestamp(), reason = :cancel_reason
    FROM cand c
    WHERE i.id = c.id AND c.cancel_requested
    RETURNING i.id
),
claimed AS (
    UPDATE job_instances i
    SET state = 'processing', claim_token = nextval('claim_token_seq'), worker_id = :worker,
        lease_expires_at = now() + make_interval(secs => :lease), started_at = clock_timestamp(),
        attempt = i.attempt + 1, progress = NULL, progress_message = NULL, reason = NULL
    FROM ranked r
    WHERE i.id = r.id AND r.rn <= r.free
    RETURNING {_cols("i")}
),
skipped AS (
    UPDATE job_instances i
    SET state = 'skipped', finished_at = clock_timestamp(), reason = :limit_reason
    FROM ranked r
    WHERE i.id = r.id AND r.rn > r.free AND r.on_limit = 'skip'
    RETURNING i.id
),
parked AS (
    UPDATE job_instances i
    SET published_at = NULL
    FROM ranked r
    WHERE i.id = r.id AND r.rn > r.free AND r.on_limit = 'wait'
    RETURNING i.id
),
took AS (
    UPDATE job_slots s SET used = s.used + t.n
    FROM (SELECT job_key, count(*) AS n FROM claimed GROUP BY job_key) t
    WHERE s.job_key = t.job_key
    RETURNING s.job_key
),
history AS (
    INSERT INTO instance_transitions (instance_id, from_state, to_state, actor, reason, claim_token)
    SELECT id, 'enqueued', 'processing', :worker, NULL, claim_token FROM claimed
    UNION ALL
    SELECT id, 'enqueued', 'skipped', :worker, :limit_reason, NULL FROM skipped
    UNION ALL
    SELECT id, 'enqueued', 'cancelled', :worker, :cancel_reason, NULL FROM cancelled
    RETURNING 1
)
SELECT '{ClaimOutcome.CLAIMED}' AS outcome, {_cols("c")},
       -- once per job key: the driver decodes each jsonb it returns, row by row
       CASE WHEN row_number() OVER (PARTITION BY c.job_key) = 1 THEN d.options END AS job_options
FROM claimed c JOIN job_definitions d ON d.key = c.job_key
UNION ALL
SELECT '{ClaimOutcome.SKIPPED}', {_cols("i")}, NULL
FROM job_instances i WHERE i.id IN (SELECT id FROM skipped)
UNION ALL
SELECT '{ClaimOutcome.WAITING}', {_cols("i")}, NULL
FROM job_instances i WHERE i.id IN (SELECT id FROM parked)
UNION ALL
SELECT '{ClaimOutcome.CANCELLED}', {_cols("i")}, NULL
FROM job_instances i WHERE i.id IN (SELECT id FROM cancelled)
"""

# One statement records a batch of outcomes. Each row matches only while the attempt still holds
# its claim token and is Processing: a stale worker (lease lost, instance re-claimed) writes
# nothing and leaves no history. Rows are locked in one global order, as every statement that
# locks several does (instances by id: ``locked``; slots by job key: ``slot_locks``), so this
# statement cannot deadlock with a claim (which holds slot rows in key order) or a heartbeat.
# The slot goes back in the same statement — except for an
# attempt whose code still runs (``hold``: a sync job past its timeout): its slot is recorded as
# held by that attempt in ``runaway_slots``, in the same statement, and given back later by
# ``release_runaway_rows``, so the limit counts the running code until it really stops.
# A cancel beats a retry: a Failed outcome of a row with ``cancel_requested`` ends Cancelled
# (the error kept). The flag is read from the row this UPDATE locks, so a cancel request
# committed first is seen here, and one that waited on the lock finds the retry (Scheduled,
# Enqueued) or Terminated row and cancels or refuses that.
# The columns it writes are those of ``jobplane.domain.transitions.EFFECTS`` for Processing →
# the outcome's state; ``tests/test_transitions.py`` runs it and checks them against the table.
COMPLETE_SQL = """
WITH o AS (
    SELECT * FROM unnest(
        CAST(:ids AS uuid[]), CAST(:tokens AS bigint[]), CAST(:states AS text[]),
        CAST(:results AS text[]), CAST(:errors AS text[]), CAST(:reasons AS text[]),
        CAST(:holds AS boolean[])
    ) AS o(id, token, state, result, error, reason, hold)
),
locked AS MATERIALIZED (
    SELECT i.id
    FROM job_instances i JOIN o ON o.id = i.id
    -- by primary key only (see above): not every Processing entry of ix_job_instances_state_id
    WHERE i.claim_token = o.token AND (i.state || '') = 'processing'
    ORDER BY i.id
    FOR UPDATE OF i
),
done AS (
    UPDATE job_instances i
    SET state = CASE WHEN o.state = 'failed' AND i.cancel_requested
                     THEN 'cancelled' ELSE o.state END,
        result = CAST(o.result AS jsonb), error = CAST(o.error AS jsonb),
        reason = CASE WHEN o.state = 'failed' AND i.cancel_requested
                      THEN :cancel_reason ELSE o.reason END,
        lease_expires_at = NULL,
        finished_at = CASE WHEN o.state IN ('succeeded', 'cancelled', 'terminated')
                             OR (o.state = 'failed' AND i.cancel_requested)
                           THEN clock_timestamp() END,
        published_at = CASE WHEN o.state = 'enqueued' THEN NULL ELSE i.published_at END
    FROM o
    WHERE i.id = o.id AND i.id IN (SELECT id FROM locked)
      AND i.claim_token = o.token AND (i.state || '') = 'processing'
    RETURNING i.id, i.job_key, i.state, i.claim_token, i.worker_id, i.reason, o.hold
),
slot_locks AS MATERIALIZED (
    SELECT s.job_key FROM job_slots s
    WHERE s.job_key IN (SELECT job_key FROM done WHERE NOT hold)
    ORDER BY s.job_key
    FOR UPDATE
),
released AS (
    UPDATE job_slots s SET used = s.used - d.n
    FROM (SELECT job_key, count(*) AS n FROM done WHERE NOT hold GROUP BY job_key) d
    WHERE s.job_key = d.job_key AND s.job_key IN (SELECT job_key FROM slot_locks)
    RETURNING s.job_key
),
held AS (
    INSERT INTO runaway_slots (instance_id, claim_token, job_key, worker_id, held_since)
    SELECT id, claim_token, job_key, worker_id, clock_timestamp() FROM done WHERE hold
    RETURNING 1
),
history AS (
    INSERT INTO instance_transitions (instance_id, from_state, to_state, actor, reason, claim_token)
    SELECT id, 'processing', state, worker_id, reason, claim_token FROM done
    RETURNING 1
)
SELECT id, state FROM done
"""


# One statement creates a batch of instances with their creation history. The initial state is
# decided against the database's clock (a ``run_at`` in the future means Scheduled), and a
# duplicate cron occurrence or idempotency key is not inserted (the unique indexes), so two
# schedulers firing one tick, or a replayed trigger, create nothing twice.
_CREATE_INPUT = """
input AS (
    SELECT * FROM unnest(
        CAST(:ids AS uuid[]), CAST(:job_keys AS text[]), CAST(:sources AS text[]),
        CAST(:queues AS text[]), CAST(:priorities AS integer[]), CAST(:args AS text[]),
        CAST(:scheduled_at AS timestamptz[]), CAST(:run_at AS timestamptz[]),
        CAST(:held AS boolean[]), CAST(:pinned AS text[]), CAST(:retry_of AS uuid[]),
        CAST(:idempotency AS text[]), CAST(:fingerprints AS text[]),
        CAST(:skip_reasons AS text[]), CAST(:actors AS text[])
    ) AS t(id, job_key, source, queue, priority, args, scheduled_at, run_at, held,
           pinned_worker, retry_of, idempotency_key, idempotency_fingerprint, skip_reason, actor)
)"""


# ``resolved`` (the input joined to its definitions, with its state) comes before these.
def _create_insert(
    published: str,
    conflict: str = "",
    returning: str = _cols("job_instances"),
    at: str = "clock_timestamp()",
    created: str = "now()",
) -> str:
    """The ``ins`` and ``history`` CTEs; ``published`` is the ``published_at`` written,
    ``conflict`` the one unique index a duplicate may meet (default: any of them),
    ``returning`` the columns ``ins`` returns (default: all; ``history`` needs id and state),
    ``at`` the time of the creation record (default: the clock, as the column's) and
    ``created`` the instance's ``created_at`` (default: the transaction's time)."""
    return f"""
ins AS (
    INSERT INTO job_instances (
        id, job_key, state, source, queue, priority, args, created_at, scheduled_at, run_at,
        published_at, finished_at, pinned_worker, retry_of, idempotency_key,
        idempotency_fingerprint, reason
    )
    SELECT id, job_key, state, source, COALESCE(queue, options ->> 'queue'),
           COALESCE(priority, CAST(options ->> 'priority' AS integer)), CAST(args AS jsonb),
           {created}, scheduled_at, CASE WHEN held THEN NULL ELSE run_at END, {published},
           CASE WHEN state = 'skipped' THEN now() END, pinned_worker, retry_of,
           idempotency_key, idempotency_fingerprint, skip_reason
    FROM resolved
    ON CONFLICT {conflict} DO NOTHING
    RETURNING {returning}
),
history AS (
    INSERT INTO instance_transitions (instance_id, from_state, to_state, actor, reason, at)
    SELECT ins.id, NULL, ins.state, r.actor, r.skip_reason, {at}
    FROM ins JOIN resolved r ON r.id = ins.id
    RETURNING 1
)"""


#: ``published_at`` of a created row when the caller asks (``:published``): an Enqueued one is
#: recorded as published by its insert, as ``CREATE_ONE`` does. The caller sends it next and
#: clears the mark if the send fails (``Dispatcher.publish_created``).
_PUBLISHED = "CASE WHEN state = 'enqueued' AND CAST(:published AS boolean) THEN now() END"

_STATE = """CASE WHEN t.skip_reason IS NOT NULL THEN 'skipped'
                WHEN t.held OR t.run_at > now() THEN 'scheduled'
                ELSE 'enqueued' END AS state"""

#: The columns of a created instance the insert decides (the clock, the state, the options'
#: defaults), and its arguments as stored (jsonb writes a float's exponent out in full: a
#: ``1e+23`` sent reads back as the integer, so the answer takes them from the row): the caller
#: has every other column in its records (``rows.inserted_instance``). Returning only these
#: spares the caller decoding and converting whole rows: 1,000 times a tick for the leader
#: before its publish, 1,000 times a call for a batch trigger.
DECIDED_COLUMNS = (
    "id",
    "state",
    "queue",
    "priority",
    "args",
    "created_at",
    "run_at",
    "published_at",
    "finished_at",
)

CREATE_SQL = f"""
WITH {_CREATE_INPUT},
resolved AS (
    SELECT t.*, d.options,
           {_STATE}
    FROM input t JOIN job_definitions d ON d.key = t.job_key
),
{_create_insert(_PUBLISHED, returning=", ".join(DECIDED_COLUMNS))}
SELECT * FROM ins
"""


# One statement, one round trip, creates a single triggered instance (the hot path of
# ``Dispatcher.trigger``), in autocommit: its implicit transaction is the statement's, so no
# BEGIN/COMMIT round trips. The races it closes:
# - an edit (disable, deletion) or a new argument schema (a worker's registration, which keeps
#   the version) committed after the caller validated the request against the definition it
#   had: the insert happens only while the stored definition is the one the caller checked
#   (version and schema, read in the statement's snapshot); otherwise nothing is written and
#   the row says so (``checked`` false), so the caller reads it again and decides again;
# - a replayed idempotency key: not inserted (unique index), the caller reads the first one.
# An Enqueued instance is recorded as published in the same row: its publication follows at
# once; if it fails, the caller clears the mark (``unmark_published``); if the caller dies
# first, the sweep republishes it once the mark is older than its republish threshold.
# The single row always comes back: the instance's columns are NULL when nothing was inserted.
# Its creation rule (state, columns, history) is the batch creation's: one input row.
CREATE_ONE_SQL = f"""
WITH input AS (
    SELECT CAST(:id AS uuid) AS id, CAST(:job_key AS text) AS job_key,
           CAST(:source AS text) AS source, CAST(:queue AS text) AS queue,
           CAST(:priority AS integer) AS priority, CAST(:args AS text) AS args,
           CAST(:scheduled_at AS timestamptz) AS scheduled_at,
           CAST(:run_at AS timestamptz) AS run_at, CAST(:held AS boolean) AS held,
           CAST(:pinned AS text) AS pinned_worker, CAST(:retry_of AS uuid) AS retry_of,
           CAST(:idempotency AS text) AS idempotency_key,
           CAST(:fingerprint AS text) AS idempotency_fingerprint,
           CAST(:skip_reason AS text) AS skip_reason, CAST(:actor AS text) AS actor
),
resolved AS (
    SELECT t.*, d.options,
           {_STATE}
    FROM input t JOIN job_definitions d ON d.key = t.job_key
    WHERE d.version = :version
      AND COALESCE(d.args_schema, 'null') = CAST(CAST(:args_schema AS text) AS jsonb)
),
{_create_insert("CASE WHEN state = 'enqueued' THEN now() END")}
SELECT ins.*, EXISTS (SELECT 1 FROM resolved) AS checked
FROM (SELECT 1) AS one LEFT JOIN ins ON true
"""


# The leader's republish sweep, every second: Enqueued instances whose message may be lost
# (published longer than ``:older`` seconds ago and still unclaimed, or never published
# ``:grace`` seconds after their creation) of jobs with a free slot (a full job's parked
# instances wait for a release), by (publication time, id) after ``(:after_at, :after_id)``:
# the sweep walks a backlog a page at a time. Read job by job from
# ix_job_instances_unpublished (job key, publication time, id), from the page's start in its
# order and up to the limit, so a sweep reads about the rows it returns: over all Enqueued rows
# at once, ordered by priority, it read the whole backlog every second, however little of it
# was stale. (The first page starts at the earliest time and the nil id.)
UNPUBLISHED_SQL = f"""
SELECT {_cols("i")}
FROM job_definitions d
JOIN job_slots s ON s.job_key = d.key AND s.used < d.max_concurrency
CROSS JOIN LATERAL (
    (SELECT * FROM job_instances
     WHERE job_key = d.key AND state = 'enqueued' AND published_at IS NULL
       AND created_at < now() - make_interval(secs => :grace)
     LIMIT :limit)
    UNION ALL
    (SELECT * FROM job_instances
     WHERE job_key = d.key AND state = 'enqueued'
       AND published_at < now() - make_interval(secs => :older)
       AND (published_at, id) > (CAST(:after_at AS timestamptz), CAST(:after_id AS uuid))
     ORDER BY published_at, id
     LIMIT :limit)
) i
ORDER BY i.published_at NULLS FIRST, i.id
LIMIT :limit
"""


# A worker's lease renewal: the leases it still holds (the instance Processing under that claim
# token: a stale attempt renews nothing), locked in id order as the outcome statement locks
# them (a heartbeat and the recording of outcomes of the same attempts never deadlock), found
# by primary key from the arrays of ids and tokens. Written as a list of (id, token) pairs,
# every candidate row was compared with every pair, twice: 30 ms of a backend for 512 leases,
# every heartbeat. ``now()`` is the transaction's time, as the generic store's clock read.
RENEW_SQL = """
WITH l AS (
    SELECT * FROM unnest(CAST(:ids AS uuid[]), CAST(:tokens AS bigint[])) AS l(id, token)
),
locked AS MATERIALIZED (
    SELECT i.id, l.token
    FROM job_instances i JOIN l ON l.id = i.id
    WHERE i.claim_token = l.token AND (i.state || '') = 'processing'
    ORDER BY i.id
    FOR UPDATE OF i
)
UPDATE job_instances i
SET lease_expires_at = now() + make_interval(secs => :lease)
FROM locked
WHERE i.id = locked.id AND i.claim_token = locked.token AND (i.state || '') = 'processing'
RETURNING i.id, i.cancel_requested
"""


# Built once: SQLAlchemy then compiles each of them once per process, not once per call.
CREATE = text(CREATE_SQL).columns(*(job_instances.c[name] for name in DECIDED_COLUMNS))
CLAIM = text(CLAIM_SQL).columns(*job_instances.c, job_options=job_instances.c.args.type)
COMPLETE = text(COMPLETE_SQL)
RENEW = text(RENEW_SQL).columns(
    id=job_instances.c.id.type, cancel_requested=job_instances.c.cancel_requested.type
)
CREATE_ONE = text(CREATE_ONE_SQL).columns(
    *job_instances.c, checked=job_instances.c.cancel_requested.type
)
UNPUBLISHED = text(UNPUBLISHED_SQL).columns(*job_instances.c)
# The database's clock, read on its own (no transaction around it: one round trip).
NOW = text("SELECT now() AS now").columns(now=job_instances.c.created_at.type)
