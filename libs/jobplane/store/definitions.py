"""Job definitions: registration, edits (optimistic lock), pause."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from sqlalchemy import (
    select,
    update,
)

from jobplane.domain.models import (
    JobDefinition,
)
from jobplane.domain.options import JobOptions
from jobplane.errors import (
    JobNotFoundError,
)
from jobplane.store import rows
from jobplane.store.base import SqlBase
from jobplane.store.tables import (
    job_definitions,
    job_slots,
)


class DefinitionStore(SqlBase):
    """Definition operations of the store."""

    async def register_definition(
        self, options: JobOptions, args_schema: dict[str, Any] | None, actor: str
    ) -> tuple[JobDefinition, bool]:
        async with self._write() as conn:
            now = await self._now(conn)
            inserted = await conn.execute(
                self._insert(job_definitions)
                .values(
                    key=options.key,
                    args_schema=args_schema,
                    created_at=now,
                    updated_at=now,
                    updated_by=actor,
                    **rows.definition_values(options),
                )
                .on_conflict_do_nothing(index_elements=["key"])  # type: ignore[attr-defined]
                .returning(job_definitions.c.key)
            )
            created = inserted.first() is not None
            await conn.execute(
                self._insert(job_slots)
                .values(job_key=options.key, used=0)
                .on_conflict_do_nothing(index_elements=["job_key"])  # type: ignore[attr-defined]
            )
            if not created:
                # Stored options win; only the argument schema follows the code.
                await conn.execute(
                    update(job_definitions)
                    .where(job_definitions.c.key == options.key)
                    .values(args_schema=args_schema)
                )
            row = (
                await conn.execute(
                    select(job_definitions).where(job_definitions.c.key == options.key)
                )
            ).one()
        return rows.definition_from_row(row._mapping), created

    async def save_definition(
        self, options: JobOptions, *, expected_version: int, actor: str
    ) -> JobDefinition | None:
        async with self._write() as conn:
            now = await self._now(conn)
            # Optimistic lock: two editors of one version cannot both win.
            row = (
                await conn.execute(
                    update(job_definitions)
                    .where(
                        job_definitions.c.key == options.key,
                        job_definitions.c.version == expected_version,
                    )
                    .values(
                        version=job_definitions.c.version + 1,
                        updated_at=now,
                        updated_by=actor,
                        **rows.definition_values(options),
                    )
                    .returning(*job_definitions.c)
                )
            ).first()
        return rows.definition_from_row(row._mapping) if row else None

    async def set_paused(self, key: str, paused: bool, actor: str) -> JobDefinition:
        async with self._write() as conn:
            now = await self._now(conn)
            row = (
                await conn.execute(
                    update(job_definitions)
                    .where(job_definitions.c.key == key)
                    .values(
                        paused=paused,
                        version=job_definitions.c.version + 1,
                        updated_at=now,
                        updated_by=actor,
                    )
                    .returning(*job_definitions.c)
                )
            ).first()
        if row is None:
            raise JobNotFoundError(key)
        return rows.definition_from_row(row._mapping)

    async def get_definition(self, key: str) -> JobDefinition:
        found = await self.list_definitions([key])
        if not found:
            raise JobNotFoundError(key)
        return found[0]

    async def list_definitions(self, keys: Collection[str] | None = None) -> list[JobDefinition]:
        query = select(job_definitions).order_by(job_definitions.c.key)
        if keys is not None:
            query = query.where(job_definitions.c.key.in_(list(keys)))
        async with self._read() as conn:
            result = await conn.execute(query)
            return [rows.definition_from_row(r._mapping) for r in result]

    async def definition_versions(self) -> dict[str, int]:
        async with self._read() as conn:
            result = await conn.execute(select(job_definitions.c.key, job_definitions.c.version))
            return {key: version for key, version in result}
