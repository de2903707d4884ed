"""Schema migrations with Alembic, on Postgres (asyncpg) and SQLite (aiosqlite). Reading which
revision a database is at needs no Alembic: :mod:`jobplane.store.schema`."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import text
from sqlalchemy.engine import Connection

from jobplane.store.engine import AsyncEngine

MIGRATIONS = Path(__file__).parent / "migrations"


def alembic_config(connection: Connection | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = connection
    return config


def alembic_revisions() -> list[str]:
    """This version's revisions as Alembic reads the scripts, oldest first (the light reading
    in :mod:`jobplane.store.schema` must agree; a test checks it)."""
    script = ScriptDirectory.from_config(alembic_config())
    return [r.revision for r in reversed(list(script.walk_revisions()))]


#: The Postgres advisory lock ``upgrade`` holds ("jobplane" in ASCII, as a bigint).
MIGRATION_LOCK = int.from_bytes(b"jobplane", "big")


async def upgrade(engine: AsyncEngine, revision: str = "head") -> None:
    """Upgrade to ``revision``. On Postgres, under a session-level advisory lock on the
    migration's own connection: a second ``jobplane migrate`` at the same time (a retried
    Kubernetes Job, two pipelines) waits for the first to commit, then finds nothing to do,
    instead of failing on the tables and types the first is creating."""
    async with engine.connect() as conn:
        locked = conn.dialect.name == "postgresql"
        if locked:
            await conn.execute(text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK})
            await conn.commit()
        try:
            async with conn.begin():
                await conn.run_sync(lambda sync: command.upgrade(alembic_config(sync), revision))
        finally:
            if locked and not conn.sync_connection.invalidated:
                await conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": MIGRATION_LOCK})
                await conn.commit()


async def downgrade(engine: AsyncEngine, revision: str = "base") -> None:
    async with engine.begin() as conn:
        await conn.run_sync(lambda sync: command.downgrade(alembic_config(sync), revision))
