"""Which schema revision a database is at, and which this version needs, without Alembic.

Every role checks the schema when it starts; importing Alembic (and loading the migration
scripts) for that cost each process about 10 MB for good. The revisions are named after their
files (``versions/0017_instance_counts.py`` is revision ``0017``) and form one line, so this
version's revisions are the file names in order, and a database's revision is one row of
``alembic_version``. ``tests/test_migrations.py`` checks both against Alembic's own reading.
Migrating is :mod:`jobplane.store.migrate` (with Alembic)."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import text

from jobplane.store.engine import AsyncEngine

VERSIONS = Path(__file__).parent / "migrations" / "versions"
#: Alembic's table of the applied revision.
VERSION_TABLE = "alembic_version"


def known_revisions() -> list[str]:
    """This version's revisions, oldest first."""
    return sorted(p.name.split("_", 1)[0] for p in VERSIONS.glob("[0-9][0-9][0-9][0-9]_*.py"))


def head_revision() -> str:
    return known_revisions()[-1]


def is_ancestor(revision: str) -> bool:
    """Whether ``revision`` is one of this version's revisions before the head."""
    known = known_revisions()
    return revision in known and revision != known[-1]


async def current_revision(engine: AsyncEngine) -> str | None:
    """The revision the database is at; ``None`` if it was never migrated."""
    async with engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            exists = "SELECT to_regclass(:table) IS NOT NULL"
        else:
            exists = "SELECT count(*) > 0 FROM sqlite_master WHERE type = 'table' AND name = :table"
        if not (await conn.execute(text(exists), {"table": VERSION_TABLE})).scalar():
            return None
        found = await conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}"))
        return found.scalar()
