"""Migrations upgrade an empty database, match the tables the code queries, and downgrade."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.store.factory import make_engine
from jobplane.store.migrate import current_revision, downgrade, head_revision, upgrade
from jobplane.store.tables import metadata


@pytest.fixture(params=["postgres", "sqlite"])
async def empty_engine(
    request: pytest.FixtureRequest, postgres_url: str, tmp_path: object
) -> AsyncIterator[AsyncEngine]:
    if request.param == "postgres":
        import uuid

        from tests.fixtures.store import admin, database_url_for

        name = f"jpmig_{uuid.uuid4().hex[:12]}"
        admin(postgres_url, f'CREATE DATABASE "{name}"')
        engine = make_engine(database_url_for(postgres_url, name))
        try:
            yield engine
        finally:
            await engine.dispose()
            admin(postgres_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    else:
        engine = make_engine(f"sqlite:///{tmp_path}/empty.db")
        try:
            yield engine
        finally:
            await engine.dispose()


async def _tables(engine: AsyncEngine) -> set[str]:
    async with engine.connect() as conn:
        return set(await conn.run_sync(lambda sync: inspect(sync).get_table_names()))


async def test_upgrade_then_downgrade_cleanly(empty_engine: AsyncEngine) -> None:
    assert await current_revision(empty_engine) is None
    await upgrade(empty_engine)
    assert await current_revision(empty_engine) == head_revision()
    assert set(metadata.tables) <= await _tables(empty_engine)
    await upgrade(empty_engine)  # idempotent
    await downgrade(empty_engine)
    assert await current_revision(empty_engine) is None
    assert await _tables(empty_engine) <= {"alembic_version"}
    await upgrade(empty_engine)  # and back up again
    assert await current_revision(empty_engine) == head_revision()


async def test_migrations_match_the_tables_the_code_uses(empty_engine: AsyncEngine) -> None:
    await upgrade(empty_engine)
    async with empty_engine.connect() as conn:
        diffs = await conn.run_sync(
            lambda sync: compare_metadata(MigrationContext.configure(sync), metadata)
        )
    assert diffs == []
