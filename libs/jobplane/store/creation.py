"""Instance creation: the one rule for a new instance's row, and the statements that write it.

Every path that creates instances goes through here: the store's batch creation (triggers,
cron fires, retries, on both backends) and the in-transaction :func:`jobplane.enqueue`, which
runs these statements on the application's own connection. The Postgres statements that create
instances in one round trip (``store/postgres_sql.py``) state the same rule in SQL;
``tests/test_creation.py`` runs every path over the same requests and compares the rows.

The rule (:func:`initial_state`): ``skip_reason`` → Skipped (a misfire recorded, finished at
once); ``held`` → Scheduled with no due time (run by hand); ``run_at`` later than the store's
clock → Scheduled (the leader promotes it when due); otherwise Enqueued, a ``run_at`` in the
past included.
"""

from __future__ import annotations

import functools
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from sqlalchemy import ColumnElement, Insert, Select, func, literal, or_, select
from sqlalchemy.dialects import postgresql, sqlite

from jobplane.domain.models import NewInstance
from jobplane.domain.options import JobOptions
from jobplane.domain.states import InstanceState
from jobplane.idempotency import fingerprint_of
from jobplane.store.tables import instance_transitions, job_definitions, job_instances
from jobplane.store.types import UtcDateTime

#: The Postgres ``NOTIFY`` channel on which an instance enqueued in an application's
#: transaction is announced to the leader (delivered on commit only).
ENQUEUED_CHANNEL = "jobplane_enqueued"
#: On the same channel, ``due:<run_at as epoch seconds>`` announces an instance made
#: Scheduled (written by a database trigger on Postgres: migration 0023).
DUE_PREFIX = "due:"


def initial_state(new: NewInstance, now: datetime) -> InstanceState:
    """The state ``new`` is created in, ``now`` being the store's clock."""
    if new.skip_reason is not None:
        return InstanceState.SKIPPED
    if new.held or (new.run_at is not None and new.run_at > now):
        return InstanceState.SCHEDULED
    return InstanceState.ENQUEUED


def instance_values(new: NewInstance, options: JobOptions, now: datetime) -> dict[str, Any]:
    """The ``job_instances`` row for ``new`` of a job with ``options``, created at ``now``."""
    state = initial_state(new, now)
    return {
        "id": new.id,
        "job_key": new.job_key,
        "state": state.value,
        "source": new.source.value,
        "queue": new.queue or options.queue,
        "priority": options.priority if new.priority is None else new.priority,
        "args": new.args,
        "created_at": now,
        "scheduled_at": new.scheduled_at,
        "run_at": None if new.held else new.run_at,
        "finished_at": now if state.is_terminal else None,
        "pinned_worker": new.pinned_worker,
        "retry_of": new.retry_of,
        "idempotency_key": new.idempotency_key,
        "idempotency_fingerprint": fingerprint_of(new),
        "reason": new.skip_reason,
    }


def history_values(new: NewInstance, values: dict[str, Any]) -> dict[str, Any]:
    """The creation's history row (``at`` defaults to the database's clock)."""
    return {
        "instance_id": values["id"],
        "from_state": None,
        "to_state": values["state"],
        "actor": new.actor,
        "reason": new.skip_reason,
    }


# The rows go as the statements' parameters (``conn.execute(INSERT, rows)``), never in their
# ``values()``: a statement holding its rows is compiled again at every call (SQLAlchemy
# caches no multi-row VALUES), and that compilation was most of a trigger's CPU on SQLite and
# of an ``enqueue()`` (docs/benchmarks.md, "The embedded default and enqueue()"). Several rows
# are sent as one statement all the same (SQLAlchemy's "insertmanyvalues").
@functools.cache
def insert_instances(dialect: str) -> Insert:
    """Insert rows of :func:`instance_values` (its parameters), returning the ids inserted.
    A duplicate cron occurrence or a replayed idempotency key is not inserted (the unique
    indexes): its id does not come back, and the caller finds the existing instance
    (:func:`replay_candidates`)."""
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    return insert(job_instances).on_conflict_do_nothing().returning(job_instances.c.id)


#: Insert rows of :func:`history_values` (its parameters).
INSERT_HISTORY: Insert = instance_transitions.insert()


def clock(dialect: str) -> ColumnElement[datetime]:
    """The store's clock: the database's ``now()`` on Postgres (the transaction's start), the
    process's clock on SQLite (one process owns the file; SQLite's own has second precision)."""
    if dialect == "postgresql":
        return func.now()
    return literal(datetime.now(UTC), UtcDateTime)


def definition_and_clock(key: str, dialect: str) -> Select[Any]:
    """The job's stored options and argument schema, with the store's clock, in one read."""
    return select(
        job_definitions.c.options, job_definitions.c.args_schema, clock(dialect).label("now")
    ).where(job_definitions.c.key == key)


def replay_candidates(key: str, job_key: str) -> Select[Any]:
    """The instances that can block an insert under idempotency ``key`` for ``job_key``: one
    with a fingerprint (any job; the key alone is unique among them), or an older one of the
    job."""
    i = job_instances.c
    return select(job_instances).where(
        i.idempotency_key == key,
        or_(i.job_key == job_key, i.idempotency_fingerprint.is_not(None)),
    )


def notify_enqueued(instance_id: UUID) -> Select[Any]:
    """Announce an enqueued instance to the leader; transactional on Postgres: delivered when
    (and only if) the caller commits."""
    return select(func.pg_notify(ENQUEUED_CHANNEL, str(instance_id)))
