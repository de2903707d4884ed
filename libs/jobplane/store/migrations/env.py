"""Alembic environment. Run through :func:`jobplane.store.migrate.upgrade`, which hands in an
open connection; ``alembic`` on the command line is not needed."""

from __future__ import annotations

from alembic import context
from sqlalchemy.engine import Connection

from jobplane.store.tables import metadata

config = context.config


def run_migrations(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations with `jobplane migrate`, which provides the connection")
run_migrations(connection)
