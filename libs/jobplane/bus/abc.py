"""The bus contract, shared by the Redis Streams bus and the in-process bus.

Semantics both implementations keep:

- One stream per (queue, priority band) and one per worker for pinned instances.
- A consumer group ``workers`` per stream, created idempotently; each worker consumes under a
  stable consumer name (its worker id), so its pending entries survive a restart.
- :meth:`Consumer.read` returns a batch and blocks at most ``block_ms`` so a consumer can stop.
- :meth:`Consumer.ack` acknowledges *and deletes* entries once handled; unread entries are never
  trimmed away.
- :meth:`Consumer.reclaim` takes over entries delivered to any consumer and idle past a timeout.
- An entry that cannot be decoded goes to the dead-letter stream with one log line; the consumer
  acknowledges the original and keeps going.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol
from uuid import UUID

from jobplane.bus.envelope import Envelope, Event


@dataclass(frozen=True, slots=True)
class BusEpoch:
    """What the bus's data is: it changed, and may be lost, when either part changes."""

    #: Changes when the server restarts (Redis: its run_id).
    run_id: str
    #: The marker written by :meth:`Bus.mark_epoch`; ``None`` when it is gone — the data was
    #: flushed (FLUSHALL / FLUSHDB on a live Redis keeps its run_id) or never marked.
    marker: str | None


@dataclass(frozen=True, slots=True)
class Delivery:
    """An entry handed to a consumer: ack it once the claim has committed."""

    stream: str
    entry_id: str
    envelope: Envelope
    times_delivered: int = 1
    #: The queue whose stream it came from (``None``: the worker's own stream, where pinned
    #: and forwarded entries go).
    queue: str | None = None


@dataclass(frozen=True, slots=True)
class DeadLetter:
    stream: str  # the stream the entry came from
    entry_id: str
    raw: bytes
    error: str


@dataclass(frozen=True, slots=True)
class StreamStats:
    """What one band stream of a queue holds, for metrics and autoscaling."""

    queue: str
    band: int
    #: Entries in the stream: unread ones and delivered ones not yet acknowledged (an
    #: acknowledged entry is deleted).
    length: int
    #: Entries never delivered to the consumer group: what waits for a worker.
    lag: int
    #: Entries delivered and not yet acknowledged (being claimed, or left by a gone consumer).
    pending: int


class Consumer(Protocol):
    """A worker's view of its queues' streams (plus its own pinned stream)."""

    async def read(self, count: int, block_ms: int) -> list[Delivery]:
        """Up to ``count`` new entries, highest band first. Non-blocking over the bands in
        order; only when all are empty does it block up to ``block_ms`` on all of them."""

    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        """Acknowledge and delete the entries (XACK + XDEL in one round trip)."""

    async def reclaim(self, min_idle_ms: int, count: int) -> list[Delivery]:
        """Take over up to ``count`` entries pending on any consumer and idle ≥ ``min_idle_ms``."""

    async def requeue(self, deliveries: Sequence[Delivery]) -> None:
        """Put copies of the entries back at the end of their streams and ack the originals
        (a job no live worker knows yet: try again later). An entry no longer pending (moved
        or acknowledged since, here or by a consumer that reclaimed it) gets no copy."""

    async def forward(self, deliveries: Sequence[Delivery], worker_id: str) -> None:
        """Move the entries to ``worker_id``'s own stream and ack the originals (a job this
        worker does not know, for a worker that does); as :meth:`requeue`, an entry no longer
        pending is not copied."""


class Bus(Protocol):
    async def close(self) -> None:
        """Release connections the bus created (a client handed in is not closed)."""

    async def ping(self) -> None:
        """Raise :class:`~jobplane.errors.BusUnavailableError` unless the bus answers."""

    async def epoch(self) -> BusEpoch:
        """Read what identifies the bus's data (reads only). The data may be gone when it
        differs from what was read before, or its marker is missing."""

    async def mark_epoch(self) -> BusEpoch:
        """Write the data marker if it is missing (set-if-absent: two leaders racing write
        one), then return the epoch."""

    async def publish(self, envelopes: Sequence[tuple[str, Envelope]]) -> None:
        """Append ``(queue, envelope)`` pairs: to the queue's band stream, or to the pinned
        worker's stream when ``envelope.pinned_worker`` is set, each stream's in the order
        given. One round trip for the entries of one queue or one worker (Redis: two when they
        span several). The same as :meth:`publish_encoded` of :meth:`encode`."""

    def encode(self, envelopes: Sequence[tuple[str, Envelope]]) -> list[tuple[str, bytes]]:
        """The entries :meth:`publish` appends for ``envelopes``, made ready beforehand: (the
        stream each goes to, its encoding). The leader encodes a cron tick's messages before
        the tick, so that at the tick only their append is left."""

    async def publish_encoded(self, entries: Sequence[tuple[str, bytes]]) -> None:
        """Append what :meth:`encode` made, as :meth:`publish` would."""

    async def queued(
        self, envelopes: Sequence[tuple[str, Envelope]], *, stuck_after_ms: int | None = None
    ) -> set[UUID]:
        """The instance ids among ``envelopes`` that still have an entry in the stream they
        would be published to: unread, or delivered and not yet acknowledged (an
        acknowledged entry is deleted). Such a message is not lost; publishing it again would
        only grow the stream. With ``stuck_after_ms``, an entry delivered that long ago and
        still unacknowledged does not count (its consumer may be gone)."""

    async def drop_pinned(self, worker_id: str, instance_ids: Collection[UUID]) -> int:
        """Delete (acknowledge and delete) the entries of ``instance_ids`` from
        ``worker_id``'s own stream; other entries stay. For a worker that is gone, whose
        pinned instances were given to any worker: nobody reads its stream, so their old
        entries would stay there for good. Returns the entries deleted."""

    async def forget_worker(self, worker_id: str, queues: Sequence[str]) -> bool:
        """Forget a worker gone for good: its own stream and its dead letters, and its
        consumer in the group of each band stream of ``queues``. Each process start is a new
        worker id: kept, these added up for ever. A consumer with entries still pending on
        it is kept (another worker reclaims them): then False, and a later call forgets it.
        The worker's pins were given away long before: its stream goes whatever it holds."""

    def consumer(self, worker_id: str, queues: Sequence[str]) -> Consumer:
        """The consumer of ``worker_id`` on ``queues`` (groups are created on first read)."""

    async def dead_letters(self, queue: str, count: int = 100) -> list[DeadLetter]:
        """The dead-letter entries of ``queue`` (oldest first)."""

    async def stream_lengths(self, queue: str) -> dict[str, int]:
        """Entries currently in each band stream of ``queue`` (for metrics and autoscaling)."""

    async def stream_stats(self, queues: Collection[str]) -> list[StreamStats]:
        """Length, consumer-group lag and pending entries of every band stream of ``queues``
        (a stream or group not created yet counts zero), in one round trip. Pinned workers'
        streams are not included."""

    # -- definition cache support ----------------------------------------------------------

    async def set_pending_updates(self, versions: dict[str, int]) -> None:
        """Mark edited definitions: job key → the version caches must reload to."""

    async def get_pending_updates(self, keys: Collection[str] | None = None) -> dict[str, int]:
        """Pending edits among ``keys`` (all when ``None``)."""

    async def clear_pending_update(self, key: str, version: int) -> bool:
        """Remove the mark of ``key`` only if it still names ``version`` (a newer edit stays)."""

    # -- broadcast events ------------------------------------------------------------------

    async def publish_event(self, event: Event) -> None: ...

    def subscribe(self) -> AsyncIterator[Event]:
        """Events published from now on, by any process on this bus. Undecodable ones are
        logged and dropped. Ends when the bus closes."""
