"""Publishing instances on the bus, with their ``published_at`` bookkeeping in the store: the
half of :class:`~jobplane.dispatch.Dispatcher` that the scheduler's fires and sweeps use too.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, replace
from uuid import UUID

from jobplane import telemetry
from jobplane.bus.abc import Bus
from jobplane.domain.models import Instance, LeaderLease
from jobplane.domain.states import InstanceState
from jobplane.errors import BusUnavailableError, StoreRefusedError, UnavailableError
from jobplane.store.abc import DispatchStore
from jobplane.triggering import envelope_for

# The dispatcher's logger name, as before the split (operators filter on it).
logger = logging.getLogger("jobplane.dispatch")


@dataclass(frozen=True)
class CreatedPublication:
    """What :meth:`Dispatcher.publish_created` sends for a write's ``instances``: ``marked``
    (created, Enqueued, marked published by the write) as ``entries``, their messages encoded
    (:meth:`~jobplane.bus.abc.Bus.encode`; ``None`` when traced: encoded as they are sent);
    every other one through the general publish."""

    instances: Sequence[Instance]
    marked: list[Instance]
    entries: list[tuple[str, bytes]] | None


#: Retries created per store statement by :meth:`Dispatcher.retry_many`.


class Publisher:
    """Sends instances' messages and records them as published (see Dispatcher)."""

    store: DispatchStore
    bus: Bus
    #: The leader's lease when the scheduler publishes: its ``published_at`` bookkeeping is a
    #: leader write, fenced by the term like the others.
    fence: LeaderLease | None
    #: The last send failed (the bus is out of reach): see :meth:`publish`.
    _bus_failed: bool

    @property
    def marks_first(self) -> bool:
        """Whether a publication is recorded before its send: not while the bus is out of
        reach (see :meth:`publish`). A creator that marks in its own write asks this."""
        return not self._bus_failed

    async def publish_created(
        self, instances: Sequence[Instance], created: set[UUID]
    ) -> list[Instance]:
        """Publish what a write that may mark its instances published created (a cron fire,
        :meth:`~jobplane.store.abc.LeaderStore.fire`): those of ``created`` (the ids asked
        for) that came back Enqueued and marked are sent as they are, their marks cleared if
        the send fails; any other (recorded before, unmarked) goes through :meth:`publish`.
        Returns ``instances``; those whose marks a failed send cleared, without them."""
        return await self.publish_prepared(self.prepare_created(instances, created, False))

    def prepare_created(
        self, instances: Sequence[Instance], created: set[UUID], encode: bool = True
    ) -> CreatedPublication:
        """What :meth:`publish_created` sends, with ``encode`` its messages encoded: made
        before a cron tick written ahead of it is committed, so that only their append is
        left at the tick."""
        marked = [
            i
            for i in instances
            if i.id in created and i.state is InstanceState.ENQUEUED and i.published_at
        ]
        # Traced, each entry carries its publish span, which exists only once it is sent.
        entries = (
            self.bus.encode([(i.queue, envelope_for(i)) for i in marked])
            if encode and not telemetry.tracer()
            else None
        )
        return CreatedPublication(instances, marked, entries)

    async def publish_prepared(self, prepared: CreatedPublication) -> list[Instance]:
        """:meth:`publish_created` of what :meth:`prepare_created` made."""
        instances, marked = prepared.instances, prepared.marked
        unsent = bool(marked) and not await self._send(marked, prepared.entries)
        cleared = unsent and await self._unmark([i.id for i in marked])
        tried = {i.id for i in marked}
        await self.publish([i for i in instances if i.id not in tried])
        cut = tried if cleared else set()
        return [replace(i, published_at=None) if i.id in cut else i for i in instances]

    async def publish(self, instances: Sequence[Instance], *, force: bool = False) -> None:
        """Publish the Enqueued ones among ``instances`` that were not published yet (all of
        them with ``force``: republishing, as the earlier message may be gone); record it.

        The mark is written before the messages are sent, as a single trigger writes it with
        the instance. The other order loses a race: a worker can read the message and claim
        at once, and a claim that finds the job at its limit (``on_limit="wait"``) parks the
        instance by clearing its mark, so that whoever frees a slot republishes it; a mark
        written after that park hid the parked instance until the sweep's republish
        threshold. Marked first, a park always comes after the mark. If the send then fails,
        the mark is cleared again; if this process dies in between, the sweep republishes
        the marked instance once its mark is older than the republish threshold.

        While the bus is out of reach (the last send failed), marking first would write and
        clear the mark of every batch the sweep retries, each pass, for nothing: then the
        send goes first and the mark follows a send that worked (the race above may then
        delay one batch until the sweep's threshold, never lose it)."""
        due = [
            i
            for i in instances
            if i.state is InstanceState.ENQUEUED and (force or not i.published_at)
        ]
        if not due:
            return
        ids = [i.id for i in due]
        if self._bus_failed:
            if await self._send(due):
                await self._mark(ids)
            return
        marked = await self._mark(ids)
        if not await self._send(due) and marked:
            await self._unmark(ids)

    async def _mark(self, ids: list[UUID]) -> bool:
        """Record ``ids`` as published; False (logged) when the store cannot say so now."""
        # Bookkeeping: the instances are committed, so they are still sent (an API client must
        # not see an error and retry a committed trigger). Unmarked, the sweep may publish them
        # again (a second message for an instance is harmless: the claim takes it once).
        return await _bookkept(
            self.store.mark_published(ids, fence=self.fence),
            f"could not record {len(ids)} instance(s) as published",
            "the sweep may republish them",
            "dispatch.mark_published_failed",
        )

    async def _unmark(self, ids: list[UUID]) -> bool:
        """Clear the marks of instances whose messages were not sent, so the sweep publishes
        them at its next pass (True); if even that fails, it does once the marks are old."""
        return await _bookkept(
            self.store.unmark_published(ids),
            f"could not clear the publish mark of {len(ids)} instance(s)",
            "the sweep republishes them after its threshold",
            "dispatch.unmark_failed",
        )

    async def _send(
        self, due: Sequence[Instance], entries: Sequence[tuple[str, bytes]] | None = None
    ) -> bool:
        """Hand ``due`` to the bus (``entries``: their messages, encoded already); False
        (logged) when it is out of reach."""
        try:
            with telemetry.span("jobplane.publish", instances=len(due)):
                if entries is not None:
                    await self.bus.publish_encoded(entries)
                else:
                    trace = telemetry.traceparent()  # one per batch: its entries share the span
                    await self.bus.publish([(i.queue, envelope_for(i, trace)) for i in due])
        except BusUnavailableError:
            self._bus_failed = True
            # Not an error for the caller: the instance is stored; the sweep republishes it.
            logger.warning(
                "bus unavailable; %d instance(s) left for the sweep to publish",
                len(due),
                extra={"action": "dispatch.publish_deferred"},
            )
            return False
        self._bus_failed = False
        return True


async def _bookkept(write: Awaitable[object], failed: str, then: str, action: str) -> bool:
    """Await a ``published_at`` write; False, logged as ``failed`` and what follows (``then``),
    when the store cannot take it now (it is bookkeeping: the caller goes on)."""
    try:
        await write
    except (UnavailableError, StoreRefusedError) as exc:
        logger.warning(
            "%s: %s; %s",
            failed,
            exc,
            then,
            exc_info=not isinstance(exc, UnavailableError),
            extra={"action": action},
        )
        return False
    return True
