"""The metadata store: SQLAlchemy tables, Alembic migrations, Postgres and SQLite backends."""

from __future__ import annotations
