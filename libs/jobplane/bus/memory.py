"""The in-process bus: the embedded default of ``jobplane dev``.

It keeps the Redis Streams semantics the worker relies on: consumer groups with a pending list
per consumer, entries that stay until acknowledged (ack deletes), reclaim of entries idle on
any consumer, dead letters for undecodable entries, pending-update marks and broadcast events.
Only one process sees it, so it carries only what that process triggers.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass, field

from jobplane.bus.abc import BusEpoch, DeadLetter, Delivery, StreamStats
from jobplane.bus.envelope import Envelope, Event, undecodable
from jobplane.bus.keys import BANDS, Keys
from jobplane.errors import EnvelopeError

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    consumer: str
    delivered_at: float
    count: int


@dataclass
class _Stream:
    entries: dict[int, bytes] = field(default_factory=dict)  # insertion order = id order
    last_delivered: int = 0  # the group's cursor: entries above it were never delivered
    pending: dict[int, _Pending] = field(default_factory=dict)


class MemoryBus:
    """An asyncio bus inside one process. Create it inside the running loop's lifetime."""

    def __init__(self, keys: Keys | None = None) -> None:
        self.keys = keys or Keys()
        self._streams: dict[str, _Stream] = {}
        self._dead: dict[str, list[DeadLetter]] = {}
        self._ids = itertools.count(1)
        self._changed = asyncio.Condition()
        self._pending_updates: dict[str, int] = {}
        self._subscribers: list[asyncio.Queue[Event | None]] = []
        self._epoch = uuid.uuid4().hex
        self._marker: str | None = None
        self._closed = False

    async def close(self) -> None:
        self._closed = True
        for queue in self._subscribers:
            queue.put_nowait(None)

    async def ping(self) -> None:
        return None

    async def epoch(self) -> BusEpoch:
        return BusEpoch(self._epoch, self._marker)

    async def mark_epoch(self) -> BusEpoch:
        if self._marker is None:
            self._marker = uuid.uuid4().hex
        return await self.epoch()

    def _stream(self, key: str) -> _Stream:
        return self._streams.setdefault(key, _Stream())

    def _append(self, key: str, raw: bytes) -> int:
        entry_id = next(self._ids)
        self._stream(key).entries[entry_id] = raw
        return entry_id

    def _append_raw(self, key: str, raw: bytes) -> None:
        """Add an entry as-is (tests use it to inject malformed entries)."""
        self._append(key, raw)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def publish(self, envelopes: Sequence[tuple[str, Envelope]]) -> None:
        await self.publish_encoded(self.encode(envelopes))

    def encode(self, envelopes: Sequence[tuple[str, Envelope]]) -> list[tuple[str, bytes]]:
        return [(self.keys.stream_of(queue, e), e.encode()) for queue, e in envelopes]

    async def publish_encoded(self, entries: Sequence[tuple[str, bytes]]) -> None:
        for key, raw in entries:
            self._append(key, raw)
        await self._notify()

    async def queued(
        self, envelopes: Sequence[tuple[str, Envelope]], *, stuck_after_ms: int | None = None
    ) -> set[uuid.UUID]:
        wanted = {envelope.instance_id for _, envelope in envelopes}
        found: set[uuid.UUID] = set()
        now = time.monotonic()
        for key in {self.keys.stream_of(queue, envelope) for queue, envelope in envelopes}:
            stream = self._stream(key)
            for entry_id, raw in stream.entries.items():
                pending = stream.pending.get(entry_id)
                if (
                    stuck_after_ms is not None
                    and pending is not None
                    and (now - pending.delivered_at) * 1000 >= stuck_after_ms
                ):
                    continue
                try:
                    instance_id = Envelope.decode(raw).instance_id
                except EnvelopeError:
                    continue
                if instance_id in wanted:
                    found.add(instance_id)
        return found

    async def forget_worker(self, worker_id: str, queues: Sequence[str]) -> bool:
        self._streams.pop(self.keys.worker_stream(worker_id), None)
        self._dead.pop(self.keys.worker_dead_letter(worker_id), None)
        # (No registry of consumers here: they are the names on the pending entries.)
        streams = [k for q in queues for k in self.keys.queue_streams(q) if k in self._streams]
        pending = (p for k in streams for p in self._streams[k].pending.values())
        return not any(p.consumer == worker_id for p in pending)

    async def drop_pinned(self, worker_id: str, instance_ids: Collection[uuid.UUID]) -> int:
        stream, wanted = self._stream(self.keys.worker_stream(worker_id)), set(instance_ids)
        doomed = []
        for entry_id, raw in stream.entries.items():
            try:
                if Envelope.decode(raw).instance_id in wanted:
                    doomed.append(entry_id)
            except EnvelopeError:
                continue
        for entry_id in doomed:
            stream.entries.pop(entry_id, None)
            stream.pending.pop(entry_id, None)
        if not stream.entries and not stream.pending and not stream.last_delivered:
            # Emptied, and never read: a worker id that never started (see RedisBus).
            self._streams.pop(self.keys.worker_stream(worker_id), None)
        return len(doomed)

    def consumer(self, worker_id: str, queues: Sequence[str]) -> MemoryConsumer:
        return MemoryConsumer(self, worker_id, queues)

    async def dead_letters(self, queue: str, count: int = 100) -> list[DeadLetter]:
        return self._dead.get(self.keys.dead_letter(queue), [])[:count]

    async def stream_lengths(self, queue: str) -> dict[str, int]:
        return {key: len(self._stream(key).entries) for key in self.keys.queue_streams(queue)}

    async def stream_stats(self, queues: Collection[str]) -> list[StreamStats]:
        found = []
        for queue in sorted(set(queues)):
            for _, band in BANDS:
                stream = self._stream(self.keys.queue_stream(queue, band))
                lag = sum(1 for entry in stream.entries if entry > stream.last_delivered)
                found.append(
                    StreamStats(queue, band, len(stream.entries), lag, len(stream.pending))
                )
        return found

    async def set_pending_updates(self, versions: dict[str, int]) -> None:
        self._pending_updates.update(versions)

    async def get_pending_updates(self, keys: Collection[str] | None = None) -> dict[str, int]:
        if keys is None:
            return dict(self._pending_updates)
        return {k: v for k, v in self._pending_updates.items() if k in keys}

    async def clear_pending_update(self, key: str, version: int) -> bool:
        if self._pending_updates.get(key) == version:
            del self._pending_updates[key]
            return True
        return False

    async def publish_event(self, event: Event) -> None:
        for queue in self._subscribers:
            queue.put_nowait(event)

    async def subscribe(self) -> AsyncIterator[Event]:
        queue: asyncio.Queue[Event | None] = asyncio.Queue()
        self._subscribers.append(queue)
        try:
            while not self._closed:
                event = await queue.get()
                if event is None:
                    return
                yield event
        finally:
            self._subscribers.remove(queue)


class MemoryConsumer:
    """One worker's consumer on the in-process bus."""

    def __init__(self, bus: MemoryBus, worker_id: str, queues: Sequence[str]) -> None:
        self.bus = bus
        self.name = worker_id
        # Highest priority first: the worker's pinned stream, then each queue's bands.
        self._dead_of = bus.keys.consumer_streams(worker_id, queues)
        self.streams = list(self._dead_of)

    async def read(self, count: int, block_ms: int) -> list[Delivery]:
        found = self._take_new(count)
        if found:
            return found
        deadline = time.monotonic() + block_ms / 1000
        async with self.bus._changed:
            while not found and not self.bus._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    await asyncio.wait_for(self.bus._changed.wait(), remaining)
                except TimeoutError:
                    break
                found = self._take_new(count)
        return found

    def _take_new(self, count: int) -> list[Delivery]:
        out: list[Delivery] = []
        now = time.monotonic()
        for key in self.streams:
            stream = self.bus._stream(key)
            for entry_id, raw in list(stream.entries.items()):
                if len(out) >= count:
                    return out
                if entry_id <= stream.last_delivered:
                    continue
                stream.last_delivered = entry_id
                stream.pending[entry_id] = _Pending(self.name, now, 1)
                delivery = self._decode(key, entry_id, raw, 1)
                if delivery is not None:
                    out.append(delivery)
        return out

    def _decode(self, key: str, entry_id: int, raw: bytes, count: int) -> Delivery | None:
        try:
            envelope = Envelope.decode(raw)
        except Exception as exc:
            # As on Redis: whatever a bad body makes the decode raise, the entry is
            # dead-lettered, never raised into the worker (which would stop, and so would
            # every worker that reclaimed the entry after it).
            dead_key = self._dead_of[key]
            error = undecodable(exc)
            self.bus._dead.setdefault(dead_key, []).append(
                DeadLetter(stream=key, entry_id=str(entry_id), raw=raw, error=error)
            )
            self._forget(key, entry_id)
            logger.warning(
                "undecodable entry %s on %s moved to %s: %s",
                entry_id,
                key,
                dead_key,
                error,
                exc_info=None if isinstance(exc, EnvelopeError) else exc,
                extra={"action": "bus.dead_letter", "stream": key},
            )
            return None
        return Delivery(
            stream=key,
            entry_id=str(entry_id),
            envelope=envelope,
            times_delivered=count,
            queue=self.bus.keys.queue_of(key),
        )

    def _forget(self, key: str, entry_id: int) -> None:
        stream = self.bus._stream(key)
        stream.entries.pop(entry_id, None)
        stream.pending.pop(entry_id, None)

    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        for d in deliveries:
            self._forget(d.stream, int(d.entry_id))

    async def reclaim(self, min_idle_ms: int, count: int) -> list[Delivery]:
        out: list[Delivery] = []
        now = time.monotonic()
        for key in self.streams:
            stream = self.bus._stream(key)
            for entry_id, pending in list(stream.pending.items()):
                if len(out) >= count:
                    return out
                if (now - pending.delivered_at) * 1000 < min_idle_ms:
                    continue
                stream.pending[entry_id] = _Pending(self.name, now, pending.count + 1)
                delivery = self._decode(key, entry_id, stream.entries[entry_id], pending.count + 1)
                if delivery is not None:
                    out.append(delivery)
        return out

    async def requeue(self, deliveries: Sequence[Delivery]) -> None:
        await self._move(deliveries, None)

    async def forward(self, deliveries: Sequence[Delivery], worker_id: str) -> None:
        await self._move(deliveries, self.bus.keys.worker_stream(worker_id))

    async def _move(self, deliveries: Sequence[Delivery], target: str | None) -> None:
        for d in deliveries:
            raw = self.bus._stream(d.stream).entries.get(int(d.entry_id))
            if raw is not None:
                self.bus._append(target or d.stream, raw)
            self._forget(d.stream, int(d.entry_id))
        await self.bus._notify()
