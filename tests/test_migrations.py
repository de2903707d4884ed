"""Migrations upgrade an empty database, match the tables the code queries, and downgrade."""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from jobplane.store.engine import AsyncEngine
from jobplane.store.factory import make_engine
from jobplane.store.migrate import alembic_revisions, downgrade, upgrade
from jobplane.store.schema import current_revision, head_revision, is_ancestor, known_revisions
from jobplane.store.tables import metadata
from tests.cli_helpers import JOBPLANE, ROOT, jobplane_env
from tests.fixtures.store import admin, database_url_for


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


async def _alembic_current(engine: AsyncEngine) -> str | None:
    async with engine.connect() as conn:
        return await conn.run_sync(
            lambda sync: MigrationContext.configure(sync).get_current_revision()
        )


async def test_the_schema_check_reads_revisions_as_alembic_does(empty_engine: AsyncEngine) -> None:
    # Roles check the schema without Alembic (jobplane.store.schema): it must agree with it.
    assert known_revisions() == alembic_revisions()
    assert is_ancestor(known_revisions()[0]) and not is_ancestor(head_revision())
    assert not is_ancestor("9999")
    assert await current_revision(empty_engine) is None
    for revision in known_revisions()[:3]:
        await upgrade(empty_engine, revision)
        assert await current_revision(empty_engine) == await _alembic_current(empty_engine)
        assert await current_revision(empty_engine) == revision
    await upgrade(empty_engine)
    assert await current_revision(empty_engine) == await _alembic_current(empty_engine)


async def test_migrations_match_the_tables_the_code_uses(empty_engine: AsyncEngine) -> None:
    await upgrade(empty_engine)
    async with empty_engine.connect() as conn:
        diffs = await conn.run_sync(
            lambda sync: compare_metadata(MigrationContext.configure(sync), metadata)
        )
    assert diffs == []


async def test_definition_history_starts_at_the_version_a_definition_had(
    empty_engine: AsyncEngine,
) -> None:
    await upgrade(empty_engine, "0002")
    async with empty_engine.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO job_definitions (key, kind, queue, options, max_concurrency, paused,"
                " version, created_at, updated_at, updated_by) VALUES ('old', 'triggered',"
                " 'default', :options, 1, true, 4, :at, :at, 'admin')"
            ),
            {"options": json.dumps({"key": "old"}), "at": datetime(2026, 1, 2, tzinfo=UTC)},
        )
    await upgrade(empty_engine)
    async with empty_engine.connect() as conn:
        rows = (
            await conn.execute(
                text("SELECT job_key, version, paused, action, actor FROM job_definition_versions")
            )
        ).all()
    assert [tuple(r) for r in rows] == [("old", 4, True, "import", "admin")]
    await downgrade(empty_engine, "0002")
    assert "job_definition_versions" not in await _tables(empty_engine)
    assert "job_definitions" in await _tables(empty_engine)


def test_two_migrates_at_once_on_a_fresh_database_both_succeed(postgres_url: str) -> None:
    """Two ``jobplane migrate`` at once (a retried Kubernetes Job, two pipelines): the second
    waits for the first's advisory lock, then finds the schema at head and has nothing to do."""
    name = f"jpmig_{uuid.uuid4().hex[:12]}"
    admin(postgres_url, f'CREATE DATABASE "{name}"')
    try:
        url = database_url_for(postgres_url, name)
        procs = [
            subprocess.Popen(
                [JOBPLANE, "migrate"],
                cwd=ROOT,
                env=jobplane_env(JOBPLANE_DATABASE_URL=url),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        results = [(proc.wait(timeout=120), proc.communicate()[1]) for proc in procs]
        for code, stderr in results:
            assert code == 0, stderr
            assert f"database schema at revision {head_revision()}" in stderr
            assert "Traceback" not in stderr
    finally:
        admin(postgres_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
