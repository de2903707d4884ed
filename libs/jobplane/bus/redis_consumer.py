"""A worker's consumer of the Redis Streams bus: batched reads in priority order, claims'
entries acknowledged and deleted, entries of unknown jobs put back or forwarded, undecodable
ones dead-lettered."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from redis.exceptions import ResponseError

from jobplane.bus.abc import Delivery
from jobplane.bus.envelope import Envelope
from jobplane.bus.keys import GROUP
from jobplane.bus.redis_calls import as_text, translated
from jobplane.errors import EnvelopeError

if TYPE_CHECKING:
    from jobplane.bus.redis import RedisBus

# The bus's logger, as before the consumer had a module of its own (operators filter on it).
logger = logging.getLogger("jobplane.bus.redis")

T = TypeVar("T")
#: Entries kept in a dead-letter stream (approximately: the oldest are trimmed).
DEAD_LETTER_MAXLEN = 10_000


class RedisConsumer:
    """One worker's consumer: its stable name is the worker id, so a restarted worker finds
    its pending entries again."""

    def __init__(self, bus: RedisBus, worker_id: str, queues: Sequence[str]) -> None:
        self.bus = bus
        self.client = bus.client
        self.name = worker_id
        # Highest priority first: the worker's pinned stream, then each queue's bands.
        self._dead_of = bus.keys.consumer_streams(worker_id, queues)
        self.streams = list(self._dead_of)
        self._groups_ready = False

    async def _ensure_groups(self) -> None:
        for key in self.streams:
            try:
                await self.client.xgroup_create(key, GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        self._groups_ready = True

    async def _call(self, what: str, op: Callable[[], Awaitable[T]]) -> T:
        """Run ``op``; if the group vanished (Redis restarted empty, stream deleted), recreate
        the groups and retry once."""
        async with translated(what):
            if not self._groups_ready:
                await self._ensure_groups()
            try:
                return await op()
            except ResponseError as exc:
                # NOGROUP: the stream or its group is gone; UNBLOCKED: it vanished while
                # this read blocked on it (FLUSHALL, restart). Both: recreate, read again.
                if "NOGROUP" not in str(exc) and "UNBLOCKED" not in str(exc):
                    raise
                logger.warning(
                    "consumer group missing on %s; recreating it",
                    what,
                    extra={"action": "bus.nogroup"},
                )
                await self._ensure_groups()
                return await op()

    async def read(self, count: int, block_ms: int) -> list[Delivery]:
        found = await self._read_each(count)
        if found:
            return found
        # Nothing anywhere: block on all streams at once, for one entry (one per stream would
        # overshoot ``count`` when several fill at once). What woke the read is returned as it
        # is, not topped up: a fill took a round trip between the wake-up and the claim of
        # every job that finds a worker idle, and entries that arrived meanwhile are found by
        # the next read's first pass.
        streams: dict[Any, Any] = dict.fromkeys(self.streams, ">")
        reply = await self._call(
            "xreadgroup",
            lambda: self.client.xreadgroup(GROUP, self.name, streams, count=1, block=block_ms),
        )
        found = await self._deliveries(reply)
        if len(found) > count:
            # Several streams filled between the first pass and the block, and Redis hands one
            # entry per stream: beyond ``count`` (the reader's free capacity) the entries go
            # back to the end of their streams rather than overrun it. (Should that fail, the
            # error stops this read and every entry it took stays pending, to be reclaimed.)
            found, surplus = found[:count], found[count:]
            await self.requeue(surplus)
        return found

    async def _read_each(self, count: int) -> list[Delivery]:
        """Non-blocking reads, stream by stream in priority order, never more than ``count``."""
        out: list[Delivery] = []
        for key in self.streams:
            remaining = count - len(out)
            if remaining <= 0:
                break
            reply = await self._call(
                "xreadgroup",
                lambda key=key, n=remaining: self.client.xreadgroup(  # type: ignore[misc]
                    GROUP, self.name, {key: ">"}, count=n
                ),
            )
            out += await self._deliveries(reply)
        return out

    async def _deliveries(self, reply: Any) -> list[Delivery]:
        out: list[Delivery] = []
        for stream, entries in _by_stream(reply):
            for entry_id, fields in entries:
                delivery = await self._decode(stream, entry_id, fields, 1)
                if delivery is not None:
                    out.append(delivery)
        return out

    async def _decode(
        self, stream: str, entry_id: bytes | str, fields: dict[bytes, bytes] | None, count: int
    ) -> Delivery | None:
        entry = as_text(entry_id)
        raw = (fields or {}).get(b"d")
        try:
            if raw is None:
                raise EnvelopeError("entry has no 'd' field")
            envelope = Envelope.decode(raw)
        except EnvelopeError as exc:
            await self._dead_letter(stream, entry, raw or b"", str(exc))
            return None
        return Delivery(stream=stream, entry_id=entry, envelope=envelope, times_delivered=count)

    async def _dead_letter(self, stream: str, entry_id: str, raw: bytes, error: str) -> None:
        dead = self._dead_of[stream]
        pipe = self.client.pipeline(transaction=False)
        pipe.xadd(
            dead,
            {"d": raw, "stream": stream, "id": entry_id, "error": error},
            maxlen=DEAD_LETTER_MAXLEN,
            approximate=True,
        )
        pipe.xack(stream, GROUP, entry_id)
        pipe.xdel(stream, entry_id)
        async with translated("dead letter"):
            await pipe.execute()
        logger.warning(
            "undecodable entry %s on %s moved to %s: %s",
            entry_id,
            stream,
            dead,
            error,
            extra={"action": "bus.dead_letter", "stream": stream},
        )

    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        if not deliveries:
            return
        by_stream: dict[str, list[str]] = {}
        for d in deliveries:
            by_stream.setdefault(d.stream, []).append(d.entry_id)
        pipe = self.client.pipeline(transaction=False)
        for stream, ids in by_stream.items():  # two commands per stream, whatever the batch
            pipe.xack(stream, GROUP, *ids)
            pipe.xdel(stream, *ids)
        async with translated("ack"):
            await pipe.execute()

    async def reclaim(self, min_idle_ms: int, count: int) -> list[Delivery]:
        out: list[Delivery] = []
        for key in self.streams:
            remaining = count - len(out)
            if remaining <= 0:
                break
            reply = await self._call(
                "xautoclaim",
                lambda key=key, n=remaining: self.client.xautoclaim(  # type: ignore[misc]
                    key, GROUP, self.name, min_idle_ms, "0-0", count=n
                ),
            )
            for entry_id, fields in reply[1]:
                if fields is None:
                    continue  # deleted while pending
                delivery = await self._decode(key, entry_id, fields, 2)
                if delivery is not None:
                    out.append(delivery)
        return out

    async def requeue(self, deliveries: Sequence[Delivery]) -> None:
        await self._move(deliveries, None)

    async def forward(self, deliveries: Sequence[Delivery], worker_id: str) -> None:
        await self._move(deliveries, self.bus.keys.worker_stream(worker_id))

    async def _move(self, deliveries: Sequence[Delivery], target: str | None) -> None:
        if not deliveries:
            return
        pipe = self.client.pipeline(transaction=False)
        for d in deliveries:
            # The copy is added before the original goes: a crash in between duplicates the
            # message (harmless: the claim is a compare-and-set) but never loses it.
            pipe.xadd(target or d.stream, {"d": d.envelope.encode()})
            pipe.xack(d.stream, GROUP, d.entry_id)
            pipe.xdel(d.stream, d.entry_id)
        async with translated("requeue"):
            await pipe.execute()


def _by_stream(reply: Any) -> list[tuple[str, list[tuple[bytes, dict[bytes, bytes]]]]]:
    """XREADGROUP replies are a list (RESP2) or a dict (RESP3) of stream → entries."""
    if not reply:
        return []
    items = reply.items() if isinstance(reply, dict) else reply
    return [(as_text(stream), entries) for stream, entries in items]
