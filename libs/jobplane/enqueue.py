"""In-transaction enqueue: create an instance inside the caller's own SQLAlchemy transaction.

.. code-block:: python

    with engine.begin() as conn:                  # the application's transaction
        conn.execute(orders.insert().values(...))
        enqueue(conn, "send_receipt", {"order_id": 7})
    # committed: the order and its job exist together; rolled back: neither does

The instance is written with its creation history in the caller's transaction, so it exists if
and only if the caller commits. Nothing is published from here (the bus is not transactional).
On Postgres the transaction also sends a ``NOTIFY`` (delivered only on commit), on which the
leading scheduler publishes the instance at once; the sweep publishes never-published instances
in any case, on SQLite and if the notification is lost.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any
from uuid import UUID

from sqlalchemy import Connection, Insert, func, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from jobplane.dispatch import validate_args
from jobplane.domain.models import InstanceSource
from jobplane.domain.options import JobOptions
from jobplane.domain.states import InstanceState
from jobplane.errors import JobNotFoundError
from jobplane.ids import new_id
from jobplane.store.tables import instance_transitions, job_definitions, job_instances


def enqueue(
    session_or_connection: Session | Connection,
    key: str,
    args: Any = None,
    *,
    run_at: datetime | None = None,
    priority: int | None = None,
    actor: str = "app",
) -> UUID:
    """Add an instance of ``key`` to the caller's transaction; returns its id."""
    row = session_or_connection.execute(_definition(key)).first()
    if row is None:
        raise JobNotFoundError(key)
    instance_id, statements = _statements(
        row.options, row.args_schema, key, args, run_at, priority, actor
    )
    for statement in statements:
        session_or_connection.execute(statement)
    if _dialect(session_or_connection) == "postgresql":
        session_or_connection.execute(_notify(instance_id))
    return instance_id


async def enqueue_async(
    session_or_connection: AsyncSession | AsyncConnection,
    key: str,
    args: Any = None,
    *,
    run_at: datetime | None = None,
    priority: int | None = None,
    actor: str = "app",
) -> UUID:
    """:func:`enqueue` for an ``AsyncSession`` or ``AsyncConnection``."""
    row = (await session_or_connection.execute(_definition(key))).first()
    if row is None:
        raise JobNotFoundError(key)
    instance_id, statements = _statements(
        row.options, row.args_schema, key, args, run_at, priority, actor
    )
    for statement in statements:
        await session_or_connection.execute(statement)
    if _dialect(session_or_connection) == "postgresql":
        await session_or_connection.execute(_notify(instance_id))
    return instance_id


CHANNEL = "jobplane_enqueued"


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


def _statements(
    raw_options: dict[str, Any],
    schema: dict[str, Any] | None,
    key: str,
    args: Any,
    run_at: datetime | None,
    priority: int | None,
    actor: str,
) -> tuple[UUID, tuple[Insert, Insert]]:
    options = JobOptions.model_validate(raw_options)
    if schema is not None:
        validate_args(schema, args)
    instance_id = new_id()
    # A delayed instance is Scheduled; the leader promotes it when due (database clock).
    state = InstanceState.SCHEDULED if run_at is not None else InstanceState.ENQUEUED
    now = datetime.now().astimezone()
    instance = job_instances.insert().values(
        id=instance_id,
        job_key=key,
        state=state.value,
        source=InstanceSource.TRIGGER.value,
        queue=options.queue,
        priority=options.priority if priority is None else priority,
        args=args,
        created_at=now,
        run_at=run_at,
    )
    history = instance_transitions.insert().values(
        instance_id=instance_id, from_state=None, to_state=state.value, actor=actor
    )
    return instance_id, (instance, history)
