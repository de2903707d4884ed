"""The definition cache: job definitions served from memory, reloaded only where they changed.

An edit reaches a cache three ways, fastest first (docs/architecture.md, guarantee 6):

1. the ``DEFINITIONS_CHANGED`` event, which :meth:`DefinitionCache.apply_event` turns into a
   reload of the keys it names;
2. the pending-update mark (job key → version, in Redis): :meth:`DefinitionCache.refresh`
   checks it for the keys asked and reloads only those whose cached version is older;
3. a periodic version check against Postgres (``verify``), and a full reload when the bus is
   seen to have restarted empty (its marks are gone): the backstop if Redis lost both.

The leader's fire does not wait for any of them: it names the version each job's tick was
planned under, and the store writes nothing while one is stored at another
(:class:`~jobplane.errors.DefinitionsChangedError`); those jobs are reloaded and re-planned. So
no tick fires on options replaced before it, whatever reached the cache.

Saving a definition therefore ends with :func:`announce`: mark, then event.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable

from jobplane.bus.abc import Bus
from jobplane.bus.envelope import Event, EventKind
from jobplane.domain.models import JobDefinition
from jobplane.errors import BusUnavailableError, JobNotFoundError
from jobplane.store.abc import DefinitionReads

logger = logging.getLogger("jobplane.definitions")


async def announce(bus: Bus, saved: Iterable[JobDefinition]) -> None:
    """Tell every cache that these definitions were saved: the pending-update marks first (so a
    cache that checks before the event arrives already sees them), then the event."""
    versions = {d.key: d.version for d in saved}
    if not versions:
        return
    try:
        await bus.set_pending_updates(versions)
        await bus.publish_event(Event(EventKind.DEFINITIONS_CHANGED, {"keys": sorted(versions)}))
    except BusUnavailableError as exc:
        # The edit is stored; caches pick it up at their next version check against Postgres.
        logger.warning(
            "could not announce edited definitions %s: %s",
            sorted(versions),
            exc,
            extra={"action": "definitions.announce_deferred"},
        )


class DefinitionCache:
    """One process's copy of the job definitions.

    :meth:`refresh` returns the keys whose cached definition changed (added, edited, removed),
    so a caller such as the leader re-plans exactly those.
    """

    def __init__(self, store: DefinitionReads, bus: Bus) -> None:
        self.store = store
        self.bus = bus
        self._definitions: dict[str, JobDefinition] = {}
        self._loaded = False

    @property
    def definitions(self) -> dict[str, JobDefinition]:
        """What is cached now (no I/O)."""
        return dict(self._definitions)

    async def get(self, key: str) -> JobDefinition:
        """One definition, after applying its pending update. Raises :class:`JobNotFoundError`."""
        await self.refresh([key])
        found = self._definitions.get(key)
        if found is None:
            # Not cached: a job registered since the last version check. Ask the store once.
            await self.reload([key])
            found = self._definitions.get(key)
        if found is None:
            raise JobNotFoundError(key)
        return found

    async def all(self, *, verify: bool = True) -> list[JobDefinition]:
        """Every definition, in key order. ``verify`` adds the cheap version check against
        Postgres, which also finds jobs registered (or deleted) without an announcement."""
        await self.refresh(verify=verify)
        return [self._definitions[k] for k in sorted(self._definitions)]

    async def refresh(
        self, keys: Collection[str] | None = None, *, verify: bool = False
    ) -> set[str]:
        """Apply pending updates for ``keys`` (all when ``None``); with ``verify``, also compare
        every version with Postgres. Returns the keys whose definition changed."""
        if not self._loaded:
            return await self.reload_all()
        stale: set[str] = set()
        try:
            pending = await self.bus.get_pending_updates(keys)
        except BusUnavailableError:
            pending = {}
            verify = True  # the marks are out of reach: Postgres decides
        for key, version in pending.items():
            cached = self._definitions.get(key)
            if cached is None or cached.version < version:
                stale.add(key)
        changed: set[str] = set()
        if verify:
            versions = await self.store.definition_versions()
            for key in set(self._definitions) - set(versions):
                del self._definitions[key]
                changed.add(key)
            stale |= {
                k
                for k, v in versions.items()
                if k not in self._definitions or self._definitions[k].version != v
            }
        if stale:
            changed |= await self.reload(stale)
        return changed

    async def reload(self, keys: Collection[str]) -> set[str]:
        """Read ``keys`` from Postgres; returns those whose cached definition changed."""
        found = {d.key: d for d in await self.store.list_definitions(keys)}
        changed = set()
        for key in keys:
            new = found.get(key)
            old = self._definitions.get(key)
            if new is None:
                if old is not None:
                    del self._definitions[key]
                    changed.add(key)
            elif old is None or old.version != new.version:
                # (a version only grows: a smaller one read here would be a stale replica read,
                # which this store does not have — Postgres is the one source of truth)
                self._definitions[key] = new
                changed.add(key)
        return changed

    async def reload_all(self) -> set[str]:
        """Read every definition (at start, and when the bus restarted and lost its marks)."""
        fresh = {d.key: d for d in await self.store.list_definitions()}
        changed = {
            k
            for k in set(fresh) | set(self._definitions)
            if k not in fresh
            or k not in self._definitions
            or self._definitions[k].version != fresh[k].version
        }
        self._definitions = fresh
        self._loaded = True
        return changed

    async def apply_event(self, event: Event) -> set[str]:
        """Reload what a ``DEFINITIONS_CHANGED`` event names; other events change nothing."""
        if event.kind is not EventKind.DEFINITIONS_CHANGED:
            return set()
        keys = event.data.get("keys")
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            return await self.refresh(verify=True)  # an event from a newer version: be safe
        return await self.reload(keys)
