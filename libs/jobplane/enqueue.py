"""In-transaction enqueue: create an instance inside the caller's own SQLAlchemy transaction.

.. code-block:: python

    with engine.begin() as conn:                  # the application's transaction
        conn.execute(orders.insert().values(...))
        enqueue(conn, "send_receipt", {"order_id": 7})
    # committed: the order and its job exist together; rolled back: neither does

The instance is written with its creation history in the caller's transaction, so it exists if
and only if the caller commits. As a REST trigger: a disabled job is refused
(:class:`~jobplane.dispatch.JobDisabledError`), arguments are validated, ``created_at`` (and a
``delay``'s due time) come from the database's clock, and an ``idempotency_key`` replayed with
the same request returns the first instance's id, while with a different request it raises
:class:`~jobplane.errors.IdempotencyConflictError`.

Nothing is published from here (the bus is not transactional).
On Postgres the transaction also sends a ``NOTIFY`` (delivered only on commit), on which the
leading scheduler publishes the instance at once; the sweep publishes never-published instances
in any case, on SQLite and if the notification is lost.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

from pydantic import TypeAdapter
from sqlalchemy import ColumnElement, Connection, Insert, Row, func, literal, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from jobplane.dispatch import JobDisabledError, validate_args
from jobplane.domain.limits import check_idempotency_key, check_json, to_utc
from jobplane.domain.models import InstanceSource
from jobplane.domain.options import JobKind, JobOptions
from jobplane.domain.states import InstanceState
from jobplane.errors import InvalidOptionsError, JobNotFoundError
from jobplane.idempotency import fingerprint, replay_candidates, replayed
from jobplane.ids import new_id
from jobplane.store import rows
from jobplane.store.tables import instance_transitions, job_definitions, job_instances
from jobplane.store.types import UtcDateTime


def enqueue(
    session_or_connection: Session | Connection,
    key: str,
    args: Any = None,
    *,
    run_at: datetime | None = None,
    delay: timedelta | None = None,
    priority: int | None = None,
    idempotency_key: str | None = None,
    hold: bool | None = None,
    actor: str = "app",
) -> UUID:
    """Add an instance of ``key`` to the caller's transaction; returns its id (with an
    ``idempotency_key`` seen before for the same request: the first instance's id).
    ``hold``: create it held, to be run by hand, if ``key`` is a triggered job (default: the
    ``JOBPLANE_DEBUG_HOLD_TRIGGERED`` debug mode)."""
    target = session_or_connection
    definition = target.execute(_definition(key)).first()
    plan = _plan(
        definition, key, args, run_at, delay, priority, idempotency_key, hold, _dialect(target)
    )
    if target.execute(plan.insert).first() is None:
        return plan.replayed(target.execute(plan.candidates()).all())
    target.execute(plan.history(actor))
    if plan.notifies:
        target.execute(_notify(plan.id))
    return plan.id


async def enqueue_async(
    session_or_connection: AsyncSession | AsyncConnection,
    key: str,
    args: Any = None,
    *,
    run_at: datetime | None = None,
    delay: timedelta | None = None,
    priority: int | None = None,
    idempotency_key: str | None = None,
    hold: bool | None = None,
    actor: str = "app",
) -> UUID:
    """:func:`enqueue` for an ``AsyncSession`` or ``AsyncConnection``."""
    target = session_or_connection
    definition = (await target.execute(_definition(key))).first()
    plan = _plan(
        definition, key, args, run_at, delay, priority, idempotency_key, hold, _dialect(target)
    )
    if (await target.execute(plan.insert)).first() is None:
        return plan.replayed((await target.execute(plan.candidates())).all())
    await target.execute(plan.history(actor))
    if plan.notifies:
        await target.execute(_notify(plan.id))
    return plan.id


CHANNEL = "jobplane_enqueued"


@dataclass(frozen=True, slots=True)
class _Plan:
    """The statements of one enqueue, shared by the sync and async entry points."""

    id: UUID
    key: str
    args: Any
    state: InstanceState
    insert: Insert
    dialect: str
    idempotency_key: str | None
    fingerprint: str | None

    @property
    def notifies(self) -> bool:
        """Tell the leader (Postgres only) about an instance to publish now: not a held or
        delayed one (it is published when run or due)."""
        return self.dialect == "postgresql" and self.state is InstanceState.ENQUEUED

    def history(self, actor: str) -> Insert:
        # ``at`` defaults to the database's clock.
        return instance_transitions.insert().values(
            instance_id=self.id, from_state=None, to_state=self.state.value, actor=actor
        )

    def candidates(self) -> Any:
        assert self.idempotency_key is not None  # only a keyed insert can be skipped
        return replay_candidates(self.idempotency_key, self.key)

    def replayed(self, found: Sequence[Row[Any]]) -> UUID:
        assert self.idempotency_key is not None
        instances = (rows.instance_from_row(r._mapping) for r in found)
        first = replayed(
            instances, self.idempotency_key, self.key, self.fingerprint, self.args, None
        )
        return first.id


def _plan(
    definition: Row[Any] | None,
    key: str,
    args: Any,
    run_at: datetime | None,
    delay: timedelta | None,
    priority: int | None,
    idempotency_key: str | None,
    hold: bool | None,
    dialect: str,
) -> _Plan:
    if definition is None:
        raise JobNotFoundError(key)
    options = JobOptions.from_stored(definition.options)
    if options.disabled:
        raise JobDisabledError(key)
    check_json(args, "args")
    if definition.args_schema is not None:
        validate_args(definition.args_schema, args)
    if run_at is not None and delay is not None:
        raise InvalidOptionsError("delay", "give run_at or delay, not both")
    if run_at is not None:
        run_at = to_utc(run_at, "run_at", naive_is_utc=False)
    if idempotency_key is not None:
        check_idempotency_key(idempotency_key)
    instance_id = new_id()
    now = _clock(dialect)
    due: datetime | ColumnElement[datetime] | None = run_at
    if delay is not None:
        due = now + delay
    if hold is None:
        hold = hold_triggered_from_environment()
    if hold and options.kind is JobKind.TRIGGERED:
        due = None  # held: Scheduled with no due time, until it is run by hand
        state = InstanceState.SCHEDULED
    else:
        # A delayed instance is Scheduled; the leader promotes it when due (database clock).
        state = InstanceState.SCHEDULED if due is not None else InstanceState.ENQUEUED
    print_ = fingerprint(key, args, run_at=run_at, delay=delay, priority=priority)
    insert = _insert(dialect).values(
        id=instance_id,
        job_key=key,
        state=state.value,
        source=InstanceSource.TRIGGER.value,
        queue=options.queue,
        priority=options.priority if priority is None else priority,
        args=args,
        created_at=now,
        run_at=due,
        idempotency_key=idempotency_key,
        idempotency_fingerprint=print_ if idempotency_key is not None else None,
    )
    # A replayed key is not inserted (the unique indexes); nothing then comes back.
    insert = insert.on_conflict_do_nothing().returning(job_instances.c.id)
    return _Plan(
        id=instance_id,
        key=key,
        args=args,
        state=state,
        insert=insert,
        dialect=dialect,
        idempotency_key=idempotency_key,
        fingerprint=print_ if idempotency_key is not None else None,
    )


def hold_triggered_from_environment() -> bool:
    """The ``JOBPLANE_DEBUG_HOLD_TRIGGERED`` debug mode, read from the environment of the
    application that enqueues (parsed as the roles parse it; unset: off)."""
    value = os.environ.get(HOLD_TRIGGERED_VARIABLE)
    return False if value is None else _BOOL.validate_python(value)


HOLD_TRIGGERED_VARIABLE = "JOBPLANE_DEBUG_HOLD_TRIGGERED"
_BOOL = TypeAdapter(bool)


def _clock(dialect: str) -> ColumnElement[datetime]:
    """The store's clock, as the store reads it: the database's ``now()`` on Postgres (the
    transaction's start), the process's clock on SQLite (one process owns the file)."""
    if dialect == "postgresql":
        return func.now()
    return literal(datetime.now(UTC), UtcDateTime)


def _insert(dialect: str) -> Any:
    if dialect == "postgresql":
        return postgresql.insert(job_instances)
    return sqlite.insert(job_instances)


def _notify(instance_id: UUID) -> Any:
    # Transactional: delivered when (and only if) the caller commits.
    return select(func.pg_notify(CHANNEL, str(instance_id)))


def _dialect(target: Session | Connection | AsyncSession | AsyncConnection) -> str:
    if isinstance(target, Connection | AsyncConnection):
        return target.dialect.name
    return target.get_bind().dialect.name


def _definition(key: str) -> Any:
    return select(job_definitions.c.options, job_definitions.c.args_schema).where(
        job_definitions.c.key == key
    )
