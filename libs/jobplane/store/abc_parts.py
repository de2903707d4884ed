"""The smaller store interfaces the roles' interfaces in :mod:`jobplane.store.abc` are built
from (imported from there)."""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime
from typing import Any, Protocol

from jobplane.domain.models import (
    DefinitionVersion,
    JobDefinition,
    WorkerInfo,
)
from jobplane.domain.options import JobOptions


class StoreConnection(Protocol):
    """The connection every role holds."""

    async def close(self) -> None:
        """Dispose of the connection pool."""

    async def ping(self) -> None:
        """Raise :class:`~jobplane.errors.StoreUnavailableError` unless the store answers."""

    async def now(self) -> datetime:
        """The store's clock (aware UTC): the one clock every process compares against."""

    @property
    def concurrent_reads(self) -> bool:
        """Whether reads started at once run at once (each on its own connection: Postgres).
        ``False`` where they would only queue for the same lock (SQLite: every transaction
        takes the file's), so callers run them one after the other."""


class DefinitionReads(Protocol):
    """Reading job definitions (the leader's cache, the dispatcher, the API)."""

    async def get_definition(self, key: str) -> JobDefinition:
        """Raises :class:`~jobplane.errors.JobNotFoundError`."""

    async def list_definitions(
        self, keys: Collection[str] | None = None, *, app: str | None = None
    ) -> list[JobDefinition]:
        """All definitions, or those among ``keys`` and/or registered by the App named
        ``app``, ordered by key."""

    async def definition_versions(self) -> dict[str, int]:
        """``{key: version}`` for every definition: the cheap convergence check of caches."""


class Registration(Protocol):
    """A worker registering the jobs of its app."""

    async def register_definition(
        self,
        options: JobOptions,
        args_schema: dict[str, Any] | None,
        actor: str,
        *,
        app: str | None = None,
    ) -> tuple[JobDefinition, bool]:
        """Persist ``options`` if the key is new; return ``(stored, created)``.

        An existing definition keeps its stored options (they may have been edited); only
        ``args_schema`` and ``app`` (when given: the name of the App registering it) are
        refreshed from code. The slot counter row is created with it.
        """


class DefinitionEdits(DefinitionReads, Registration, Protocol):
    """Editing job definitions, with their version history (the API)."""

    async def save_definition(
        self, options: JobOptions, *, expected_version: int, actor: str
    ) -> JobDefinition | None:
        """Replace the options of an existing definition if its version is still
        ``expected_version`` (optimistic lock); bump the version. ``None`` if it moved on.
        Every save (this, registration, pause, resume, rollback) appends the new version to
        the definition's history in the same transaction."""

    async def set_paused(self, key: str, paused: bool, actor: str) -> JobDefinition:
        """Pause or resume a job; bumps the version. Raises JobNotFoundError."""

    async def rollback_definition(
        self, key: str, to_version: int, *, expected_version: int, actor: str
    ) -> JobDefinition | None:
        """Save, as a new version, the options that version ``to_version`` had (the paused
        flag is left as it is). The same optimistic lock as :meth:`save_definition`: ``None``
        if the definition is no longer at ``expected_version``. Raises JobNotFoundError, or
        DefinitionVersionNotFoundError for a version never saved."""

    async def definition_history(self, key: str) -> list[DefinitionVersion]:
        """Every saved version of a definition (register, edit, pause, resume, rollback),
        newest first, each with its full options. Raises JobNotFoundError."""


class WorkerReads(Protocol):
    """The registered workers, as the workers and the API see them."""

    async def list_workers(self) -> list[WorkerInfo]: ...
