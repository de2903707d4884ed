"""Job definitions: registration, edits (optimistic lock), pause, version history, rollback.

Every save of a definition appends its full options to ``job_definition_versions`` in the same
transaction as the update of ``job_definitions``: a version exists in the history if and only
if it was saved, and history is never rewritten.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import (
    func,
    select,
    update,
)

from jobplane.domain.models import (
    DefinitionChange,
    DefinitionVersion,
    JobDefinition,
)
from jobplane.domain.options import JobOptions
from jobplane.errors import (
    DefinitionVersionNotFoundError,
    JobNotFoundError,
)
from jobplane.store import rows
from jobplane.store.base import SqlBase, in_slices
from jobplane.store.engine import AsyncConnection
from jobplane.store.tables import (
    job_definition_versions,
    job_definitions,
    job_slots,
)

version_cols = job_definition_versions.c
#: The options that make a job's schedule: a change to any of them starts a new schedule.
SCHEDULE_OPTIONS = ("cron", "timezone", "start_at")


def _schedule_of(options: Mapping[str, Any]) -> tuple[Any, ...]:
    return tuple(options.get(name) for name in SCHEDULE_OPTIONS)


def _reopened(current: Mapping[str, Any], edited: Mapping[str, Any], now: datetime) -> bool:
    """Whether the edit reopens a window that had ended: ``end_at`` was past and moves later
    (or goes). The ticks between the old end and the edit were never due; counted from the
    last occurrence (at the old end), they were taken for missed and fired back-dated."""
    old, new = current.get("end_at"), edited.get("end_at")
    if old is None or datetime.fromisoformat(old) >= now:
        return False
    return new is None or datetime.fromisoformat(new) > datetime.fromisoformat(old)


class DefinitionStore(SqlBase):
    """Definition operations of the store."""

    async def register_definition(
        self,
        options: JobOptions,
        args_schema: dict[str, Any] | None,
        actor: str,
        *,
        app: str | None = None,
    ) -> tuple[JobDefinition, bool]:
        async with self._write() as conn:
            now = await self._now(conn)
            inserted = (
                await conn.execute(
                    self._insert(job_definitions)
                    .values(
                        key=options.key,
                        args_schema=args_schema,
                        app=app,
                        created_at=now,
                        updated_at=now,
                        updated_by=actor,
                        **rows.definition_values(options),
                    )
                    .on_conflict_do_nothing(index_elements=["key"])  # type: ignore[attr-defined]
                    .returning(*job_definitions.c)
                )
            ).first()
            created = inserted is not None
            await conn.execute(
                self._insert(job_slots)
                .values(job_key=options.key, used=0)
                .on_conflict_do_nothing(index_elements=["job_key"])  # type: ignore[attr-defined]
            )
            if inserted is not None:
                # Only the registration that inserted the row records version 1: two workers
                # registering a new job at once cannot both write it (the primary key).
                await self._record_version(conn, inserted._mapping, DefinitionChange.REGISTER)
            else:
                # Stored options win; only the argument schema and the app follow the code,
                # written only when they differ: every worker's start registers its jobs, and
                # an update of an unchanged row would still lock it (and wait for a cron tick
                # written ahead, which share-locks its jobs' rows until the tick).
                d = job_definitions.c
                stored = (
                    await conn.execute(select(d.args_schema, d.app).where(d.key == options.key))
                ).one()
                from_code: dict[str, Any] = {}
                if stored.args_schema != args_schema:
                    from_code["args_schema"] = args_schema
                if app is not None and stored.app != app:
                    from_code["app"] = app
                if from_code:
                    await conn.execute(
                        update(job_definitions).where(d.key == options.key).values(**from_code)
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
            row = await self._update_options(conn, options, expected_version, actor)
            if row is None:
                return None
            await self._record_version(conn, row, DefinitionChange.EDIT)
        return rows.definition_from_row(row)

    async def _update_options(
        self, conn: AsyncConnection, options: JobOptions, expected_version: int, actor: str
    ) -> Mapping[Any, Any] | None:
        """Replace the options if the version is still ``expected_version``; bump it."""
        now = await self._now(conn)
        current = (
            await conn.execute(
                select(job_definitions.c.options).where(
                    job_definitions.c.key == options.key,
                    job_definitions.c.version == expected_version,
                )
            )
        ).scalar()
        schedule: dict[str, Any] = {}
        edited = options.model_dump(mode="json")
        if current is not None and (
            _schedule_of(current) != _schedule_of(edited) or _reopened(current, edited, now)
        ):
            # (Read without a lock: if another edit wins meanwhile, the version check below
            # makes this update match nothing, so what was read is what is replaced.)
            schedule = {"schedule_since": now}
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
                    **schedule,
                    **rows.definition_values(options),
                )
                .returning(*job_definitions.c)
            )
        ).first()
        return row._mapping if row is not None else None

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
            change = DefinitionChange.PAUSE if paused else DefinitionChange.RESUME
            await self._record_version(conn, row._mapping, change)
        return rows.definition_from_row(row._mapping)

    async def rollback_definition(
        self, key: str, to_version: int, *, expected_version: int, actor: str
    ) -> JobDefinition | None:
        async with self._write() as conn:
            old = (
                await conn.execute(
                    select(version_cols.options).where(
                        version_cols.job_key == key, version_cols.version == to_version
                    )
                )
            ).first()
            if old is None:
                if not await self._exists(conn, key):
                    raise JobNotFoundError(key)
                raise DefinitionVersionNotFoundError(key, to_version)
            # Validated as an edit: an older version's schedule may be refused today.
            options = JobOptions.parse(**old.options)
            # The same optimistic lock as an edit: a rollback decided on a stale read loses.
            row = await self._update_options(conn, options, expected_version, actor)
            if row is None:
                return None
            await self._record_version(
                conn, row, DefinitionChange.ROLLBACK, rolled_back_to=to_version
            )
        return rows.definition_from_row(row)

    async def definition_history(self, key: str) -> list[DefinitionVersion]:
        async with self._read() as conn:
            found = [
                rows.version_from_row(r._mapping)
                for r in await conn.execute(
                    select(job_definition_versions)
                    .where(version_cols.job_key == key)
                    .order_by(version_cols.version.desc())
                )
            ]
            if not found and not await self._exists(conn, key):
                raise JobNotFoundError(key)
        return found

    async def schedule_histories(
        self, after: Mapping[str, datetime]
    ) -> dict[str, list[DefinitionVersion]]:
        """For each job key, the versions in effect after its time in ``after``, oldest first:
        the one in effect at that time (the latest saved at or before it; all of them if none
        was) and every later one. Versions are numbered 1, 2, … in the order they were saved
        (see _record_version). One read per slice of keys, from the slice's earliest time."""
        found: dict[str, list[DefinitionVersion]] = {key: [] for key in after}
        w = job_definition_versions.alias("w")
        async with self._read() as conn:
            for some in in_slices(sorted(after)):
                in_effect = (
                    select(func.max(w.c.version))
                    .where(
                        w.c.job_key == version_cols.job_key, w.c.at <= min(after[k] for k in some)
                    )
                    .scalar_subquery()
                )
                result = await conn.execute(
                    select(job_definition_versions)
                    .where(
                        version_cols.job_key.in_(some),
                        version_cols.version >= func.coalesce(in_effect, 0),
                    )
                    .order_by(version_cols.job_key, version_cols.version)
                )
                for r in result:
                    found[r.job_key].append(rows.version_from_row(r._mapping))
        for key, versions in found.items():
            # (Read from the slice's earliest time: the ones before this key's own go.)
            since = [i for i, v in enumerate(versions) if v.at <= after[key]]
            if since:
                del versions[: since[-1]]
        return found

    async def _exists(self, conn: AsyncConnection, key: str) -> bool:
        found = await conn.execute(
            select(job_definitions.c.key).where(job_definitions.c.key == key)
        )
        return found.first() is not None

    async def _record_version(
        self,
        conn: AsyncConnection,
        saved: Mapping[Any, Any],
        action: DefinitionChange,
        *,
        rolled_back_to: int | None = None,
    ) -> None:
        """Append the definition row just saved (in this transaction) to its history. The
        row is locked by that save until commit, so versions are appended in order; the
        primary key (key, version) refuses a second record of one version."""
        await conn.execute(
            job_definition_versions.insert().values(
                job_key=saved["key"],
                version=saved["version"],
                options=saved["options"],
                paused=saved["paused"],
                action=action.value,
                actor=saved["updated_by"] or "unknown",
                at=saved["updated_at"],
                rolled_back_to=rolled_back_to,
            )
        )

    async def get_definition(self, key: str) -> JobDefinition:
        found = await self.list_definitions([key])
        if not found:
            raise JobNotFoundError(key)
        return found[0]

    async def list_definitions(
        self, keys: Collection[str] | None = None, *, app: str | None = None
    ) -> list[JobDefinition]:
        query = select(job_definitions).order_by(job_definitions.c.key)
        if app is not None:
            query = query.where(job_definitions.c.app == app)
        async with self._read() as conn:
            if keys is None:
                result = await conn.execute(query)
                return [rows.definition_from_row(r._mapping) for r in result]
            found = [
                rows.definition_from_row(r._mapping)
                for some in in_slices(sorted(keys))  # (in key order, slice after slice)
                for r in await conn.execute(query.where(job_definitions.c.key.in_(some)))
            ]
        return found

    async def definition_versions(self) -> dict[str, int]:
        async with self._read() as conn:
            result = await conn.execute(select(job_definitions.c.key, job_definitions.c.version))
            return {key: version for key, version in result}
