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
the same request returns the first instance's id (even once the job was disabled, or its
arguments' schema changed), while with a different request it raises
:class:`~jobplane.errors.IdempotencyConflictError`.

The instance's row and history are the store's (:mod:`jobplane.store.creation`, the one rule
every creation path follows): a ``run_at`` in the past is Enqueued, as through the API.

Nothing is published from here (the bus is not transactional).
On Postgres the transaction also sends a ``NOTIFY`` (delivered only on commit), on which the
leading scheduler publishes the instance at once; the sweep publishes never-published instances
in any case, on SQLite and if the notification is lost.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, cast
from uuid import UUID

from pydantic import TypeAdapter
from sqlalchemy import Connection, Insert, Row, Select

from jobplane.domain.limits import check_idempotency_key, check_json, to_utc
from jobplane.domain.models import NewInstance
from jobplane.domain.options import JobKind, JobOptions, check_delay, check_priority
from jobplane.domain.states import InstanceState
from jobplane.errors import (
    InvalidArgumentsError,
    InvalidOptionsError,
    JobDisabledError,
    JobNotFoundError,
    JobplaneError,
)
from jobplane.idempotency import fingerprint, replayed
from jobplane.store import creation, rows
from jobplane.store.engine import AsyncConnection as StoreConnection
from jobplane.triggering import validate_args

if TYPE_CHECKING:
    # Not imported at run time: SQLAlchemy's ORM and asyncio extension come with the
    # application that passes their objects, not with every Jobplane process (``import
    # jobplane`` imports this module; the two took 6 to 7 MB of each role's idle memory).
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
    from sqlalchemy.orm import Session


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
    dialect = _dialect(target)
    definition = target.execute(creation.definition_and_clock(key, dialect)).first()
    plan = _plan(definition, key, args, run_at, delay, priority, idempotency_key, hold, actor)
    if plan.refused is not None:
        return plan.replay_or_refuse(target.execute(plan.candidates()).all())
    if target.execute(*plan.insert(dialect)).first() is None:
        return plan.replayed(target.execute(plan.candidates()).all())
    target.execute(*plan.history())
    if plan.notifies(dialect):
        target.execute(creation.notify_enqueued(plan.new.id))
    return plan.new.id


async def enqueue_async(
    session_or_connection: AsyncSession | AsyncConnection | StoreConnection,
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
    """:func:`enqueue` for an ``AsyncSession`` or ``AsyncConnection`` (or a connection of a
    Jobplane store's engine)."""
    target = session_or_connection
    dialect = _dialect(target)
    definition = (await target.execute(creation.definition_and_clock(key, dialect))).first()
    plan = _plan(definition, key, args, run_at, delay, priority, idempotency_key, hold, actor)
    if plan.refused is not None:
        return plan.replay_or_refuse((await target.execute(plan.candidates())).all())
    if (await target.execute(*plan.insert(dialect))).first() is None:
        return plan.replayed((await target.execute(plan.candidates())).all())
    await target.execute(*plan.history())
    if plan.notifies(dialect):
        await target.execute(creation.notify_enqueued(plan.new.id))
    return plan.new.id


#: Kept for applications that listen themselves; the store names it.
CHANNEL = creation.ENQUEUED_CHANNEL


@dataclass(frozen=True, slots=True)
class _Plan:
    """One enqueue's instance and row, shared by the sync and async entry points."""

    new: NewInstance
    values: dict[str, Any]
    #: Why the job refuses the request now (disabled, or the arguments no longer valid), for
    #: a keyed request: a replay of one taken before still answers its first instance.
    refused: JobplaneError | None = None

    @property
    def state(self) -> InstanceState:
        return InstanceState(self.values["state"])

    def notifies(self, dialect: str) -> bool:
        """Tell the leader (Postgres only) about an instance to publish now: not a held or
        delayed one (it is published when run or due)."""
        return dialect == "postgresql" and self.state is InstanceState.ENQUEUED

    def insert(self, dialect: str) -> tuple[Insert, dict[str, Any]]:
        """The instance's insert and its row, as ``execute``'s arguments."""
        return creation.insert_instances(dialect), self.values

    def history(self) -> tuple[Insert, dict[str, Any]]:
        """Its creation record's insert and row."""
        return creation.INSERT_HISTORY, creation.history_values(self.new, self.values)

    def candidates(self) -> Select[Any]:
        assert self.new.idempotency_key is not None  # only a keyed insert can be skipped
        return creation.replay_candidates(self.new.idempotency_key, self.new.job_key)

    def replay_or_refuse(self, found: Sequence[Row[Any]]) -> UUID:
        """The first instance of this request, taken before the job refused it; else raise
        the refusal. An application retrying a transaction whose commit answer was lost must
        not read "disabled" as "not enqueued" (the REST trigger answers the same)."""
        assert self.refused is not None
        if not found:
            raise self.refused
        return self.replayed(found)

    def replayed(self, found: Sequence[Row[Any]]) -> UUID:
        new = self.new
        assert new.idempotency_key is not None
        instances = (rows.instance_from_row(r._mapping) for r in found)
        first = replayed(
            instances, new.idempotency_key, new.job_key, new.fingerprint, new.args, None
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
    actor: str,
) -> _Plan:
    if definition is None:
        raise JobNotFoundError(key)
    options = JobOptions.from_stored(definition.options)
    refused = _refusal(options, definition.args_schema, key, args)
    if refused is not None and idempotency_key is None:
        raise refused
    if run_at is not None and delay is not None:
        raise InvalidOptionsError("delay", "give run_at or delay, not both")
    check_priority(priority)
    if delay is not None:
        check_delay(delay)
    if run_at is not None:
        run_at = to_utc(run_at, "run_at", naive_is_utc=False)
    if idempotency_key is not None:
        check_idempotency_key(idempotency_key)
    now = _aware(definition.now)  # the store's clock, read with the definition
    due = now + delay if delay is not None else run_at
    if hold is None:
        hold = hold_triggered_from_environment()
    held = hold and options.kind is JobKind.TRIGGERED  # Scheduled until run by hand
    request_print = fingerprint(key, args, run_at=run_at, delay=delay, priority=priority)
    new = NewInstance(
        job_key=key,
        args=args,
        run_at=due,
        held=held,
        priority=priority,
        idempotency_key=idempotency_key,
        fingerprint=request_print if idempotency_key is not None else None,
        actor=actor,
    )
    if refused is not None:
        return _Plan(new=new, values={}, refused=refused)
    return _Plan(new=new, values=creation.instance_values(new, options, now))


def _refusal(options: JobOptions, schema: Any, key: str, args: Any) -> JobplaneError | None:
    """Why the job refuses ``args`` now: disabled, or the arguments invalid for its schema."""
    if options.disabled:
        return JobDisabledError(key)
    check_json(args, "args")
    if schema is not None:
        try:
            validate_args(schema, args)
        except InvalidArgumentsError as exc:
            return exc
    return None


def hold_triggered_from_environment() -> bool:
    """The ``JOBPLANE_DEBUG_HOLD_TRIGGERED`` debug mode, read from the environment of the
    application that enqueues (parsed as the roles parse it; unset: off)."""
    value = os.environ.get(HOLD_TRIGGERED_VARIABLE)
    return False if value is None else _BOOL.validate_python(value)


HOLD_TRIGGERED_VARIABLE = "JOBPLANE_DEBUG_HOLD_TRIGGERED"
_BOOL = TypeAdapter(bool)


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _dialect(
    target: Session | Connection | AsyncSession | AsyncConnection | StoreConnection,
) -> str:
    if isinstance(target, Connection | StoreConnection):
        return target.dialect.name
    # Loaded already if ``target`` is one of its connections (see the imports).
    extension = sys.modules.get("sqlalchemy.ext.asyncio")
    if extension is not None and isinstance(target, extension.AsyncConnection):
        return cast("AsyncConnection", target).dialect.name
    return cast("Session | AsyncSession", target).get_bind().dialect.name
