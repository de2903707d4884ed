"""The Redis Streams bus (production).

Entries carry one field, ``d``: the envelope's JSON bytes. Queue streams are never trimmed
(an unread entry must not vanish); entries are deleted when acknowledged, which the worker does
as soon as its claim has committed in Postgres.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Collection, Sequence
from contextlib import aclosing, asynccontextmanager
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from jobplane.bus.abc import BusEpoch, DeadLetter, Delivery, StreamStats
from jobplane.bus.envelope import Envelope, Event
from jobplane.bus.keys import BANDS, GROUP, Keys
from jobplane.errors import BusUnavailableError, EnvelopeError
from jobplane.tasks import being_cancelled

logger = logging.getLogger(__name__)

T = TypeVar("T")
#: Entries read per XRANGE call when looking for messages still in a stream.
XRANGE_PAGE = 1000
DEAD_LETTER_MAXLEN = 10_000

#: A field of the pending-update hash that no job key can be (keys start with a letter or a
#: digit): how many edits were marked, so a reader knows the hash changed without reading it.
EDITS_FIELD = "#edits"

# Compare-and-delete: a newer edit's mark survives the clearing of an older one.
CLEAR_PENDING_LUA = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
    return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
"""


# Append one entry per key: KEYS[i] gets ARGV[i] as its field "d" (never MAXLEN: unread stays).
APPEND_LUA = """
for i = 1, #KEYS do
    redis.call('XADD', KEYS[i], '*', 'd', ARGV[i])
end
return #KEYS
"""
#: Entries appended by one call of the script (Redis runs a script alone: ~1 ms per 1,000).
PUBLISH_CHUNK = 1000


def _hash_tag(key: str) -> str:
    """What Redis Cluster hashes of ``key``: its first non-empty ``{…}``, else the key."""
    start = key.find("{")
    if start >= 0:
        end = key.find("}", start + 1)
        if end > start + 1:
            return key[start + 1 : end]
    return key


@asynccontextmanager
async def _translated(what: str) -> AsyncIterator[None]:
    """Connection failures become :class:`BusUnavailableError` (one line, no driver types)."""
    try:
        yield
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        if being_cancelled():
            raise asyncio.CancelledError from exc  # the cancel, as the driver reported it
        raise BusUnavailableError(f"Redis unavailable ({what}): {exc}") from exc


class RedisBus:
    """Redis Streams bus. Closes ``client`` on :meth:`close` only if ``owns_client``."""

    def __init__(self, client: aioredis.Redis, keys: Keys, *, owns_client: bool) -> None:
        self.client = client
        self.keys = keys
        self._owns_client = owns_client
        self._closed = False
        self._clear_pending = client.register_script(CLEAR_PENDING_LUA)
        self._append = client.register_script(APPEND_LUA)
        #: The pending-update marks as last read whole, and the hash's (edit count, length)
        #: then (see :meth:`get_pending_updates`).
        self._marks: dict[str, int] = {}
        self._marks_seen: tuple[Any, int] | None = None

    async def close(self) -> None:
        self._closed = True
        if self._owns_client:
            await self.client.aclose()

    async def ping(self) -> None:
        async with _translated("ping"):
            await self.client.ping()

    async def epoch(self) -> BusEpoch:
        # A restart changes the run_id; a FLUSHALL/FLUSHDB on a live server does not, but it
        # deletes the marker key.
        async with _translated("epoch"):
            pipe = self.client.pipeline(transaction=False)
            pipe.info("server")
            pipe.get(self.keys.epoch_marker())
            info, marker = await pipe.execute()
        return BusEpoch(str(info["run_id"]), None if marker is None else _text(marker))

    async def mark_epoch(self) -> BusEpoch:
        async with _translated("mark epoch"):
            await self.client.set(self.keys.epoch_marker(), uuid.uuid4().hex, nx=True)
        return await self.epoch()

    async def publish(self, envelopes: Sequence[tuple[str, Envelope]]) -> None:
        if not envelopes:
            return
        async with _translated("publish"):
            if len(envelopes) == 1:
                # A single trigger's message: the command alone, without a pipeline's
                # bookkeeping (a quarter of the publish's CPU; the same one round trip).
                [(queue, envelope)] = envelopes
                await self.client.xadd(
                    self.keys.stream_of(queue, envelope), {"d": envelope.encode()}
                )
                return
            # Several: appended by a script, one command for up to PUBLISH_CHUNK entries of
            # one hash slot, rather than a pipeline of one XADD each, whose replies redis-py
            # parses one by one (a cron tick of 1,000 instances spent 44 ms of the leader's CPU
            # in the pipeline). The keys of one script call share a hash tag (a queue's
            # streams, or a worker's), as Redis Cluster requires.
            slots: dict[str, tuple[list[str], list[bytes]]] = {}
            for queue, envelope in envelopes:
                key = self.keys.stream_of(queue, envelope)
                keys, data = slots.setdefault(_hash_tag(key), ([], []))
                keys.append(key)
                data.append(envelope.encode())
            calls = [
                (keys[i : i + PUBLISH_CHUNK], data[i : i + PUBLISH_CHUNK])
                for keys, data in slots.values()
                for i in range(0, len(keys), PUBLISH_CHUNK)
            ]
            if len(calls) == 1:
                [(keys, data)] = calls
                await self._append(keys=keys, args=data)
                return
            pipe = self.client.pipeline(transaction=False)
            for keys, data in calls:
                await self._append(keys=keys, args=data, client=pipe)
            await pipe.execute()

    async def queued(
        self, envelopes: Sequence[tuple[str, Envelope]], *, stuck_after_ms: int | None = None
    ) -> set[uuid.UUID]:
        by_stream: dict[str, set[uuid.UUID]] = {}
        for queue, envelope in envelopes:
            by_stream.setdefault(self.keys.stream_of(queue, envelope), set()).add(
                envelope.instance_id
            )
        found: set[uuid.UUID] = set()
        for key, wanted in by_stream.items():
            stuck = set() if stuck_after_ms is None else await self._stuck(key, stuck_after_ms)
            missing = set(wanted)
            # Read from the oldest entry until every wanted one is found: the leader asks for
            # the oldest unclaimed instances, near the head of a backlog's stream, and reading
            # the whole stream each sweep cost a second per 100,000 entries.
            async with aclosing(self._entries(key)) as entries:
                async for entry_id, instance_id in entries:
                    if instance_id in missing and _text(entry_id) not in stuck:
                        missing.discard(instance_id)
                        if not missing:
                            break
            found |= wanted - missing
        return found

    async def _entries(self, key: str) -> AsyncGenerator[tuple[Any, uuid.UUID], None]:
        """(entry id, instance id) of every decodable entry of the stream ``key``, oldest
        first, read a page at a time (an undecodable one is the reader's to dead-letter)."""
        start = "-"
        while True:
            async with _translated("xrange"):
                page: Any = await self.client.xrange(key, min=start, count=XRANGE_PAGE)
            for entry_id, fields in page or []:
                try:
                    yield entry_id, Envelope.decode(fields.get(b"d", b"")).instance_id
                except EnvelopeError:
                    continue
            if len(page or []) < XRANGE_PAGE:
                return
            start = "(" + _text(page[-1][0])

    async def drop_pinned(self, worker_id: str, instance_ids: Collection[uuid.UUID]) -> int:
        key, wanted = self.keys.worker_stream(worker_id), set(instance_ids)
        if not wanted:
            return 0
        doomed = [e async for e, instance_id in self._entries(key) if instance_id in wanted]
        if not doomed:
            return 0
        pipe = self.client.pipeline(transaction=False)
        pipe.xack(key, GROUP, *doomed)  # 0 when the worker never read: no group, no error
        pipe.xdel(key, *doomed)
        async with _translated("xdel"):
            await pipe.execute()
        return len(doomed)

    async def _stuck(self, key: str, idle_ms: int) -> set[str]:
        """Ids of ``key``'s entries delivered at least ``idle_ms`` ago and not acknowledged."""
        stuck: set[str] = set()
        start = "-"
        while True:
            try:
                async with _translated("xpending"):
                    page: Any = await self.client.xpending_range(
                        key, GROUP, min=start, max="+", count=XRANGE_PAGE, idle=idle_ms
                    )
            except ResponseError:
                return stuck  # no such stream or group yet: nothing delivered
            stuck.update(_text(p["message_id"]) for p in page or [])
            if len(page or []) < XRANGE_PAGE:
                return stuck
            start = "(" + _text(page[-1]["message_id"])

    def consumer(self, worker_id: str, queues: Sequence[str]) -> RedisConsumer:
        return RedisConsumer(self, worker_id, queues)

    async def dead_letters(self, queue: str, count: int = 100) -> list[DeadLetter]:
        async with _translated("xrange"):
            entries: Any = await self.client.xrange(self.keys.dead_letter(queue), count=count)
        out = []
        for _, fields in entries or []:
            out.append(
                DeadLetter(
                    stream=_text(fields.get(b"stream", b"")),
                    entry_id=_text(fields.get(b"id", b"")),
                    raw=bytes(fields.get(b"d", b"")),
                    error=_text(fields.get(b"error", b"")),
                )
            )
        return out

    async def stream_lengths(self, queue: str) -> dict[str, int]:
        keys = self.keys.queue_streams(queue)
        async with _translated("xlen"):
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.xlen(key)
            lengths = await pipe.execute()
        return dict(zip(keys, lengths, strict=True))

    async def stream_stats(self, queues: Collection[str]) -> list[StreamStats]:
        streams = [(q, band) for q in sorted(set(queues)) for _, band in BANDS]
        async with _translated("xinfo"):
            pipe = self.client.pipeline(transaction=False)
            for queue, band in streams:
                key = self.keys.queue_stream(queue, band)
                pipe.xlen(key)
                pipe.xinfo_groups(key)
            replies = await pipe.execute(raise_on_error=False)
        found = []
        for index, (queue, band) in enumerate(streams):
            length, groups = replies[2 * index], replies[2 * index + 1]
            if isinstance(length, Exception):
                raise BusUnavailableError(f"Redis refused XLEN: {length}") from length
            if isinstance(groups, ResponseError):
                groups = []  # no such stream yet
            elif isinstance(groups, Exception):
                raise BusUnavailableError(f"Redis refused XINFO: {groups}") from groups
            group = next((g for g in groups if _text(g["name"]) == GROUP), None)
            pending = int(group["pending"]) if group is not None else 0
            # Redis 7 reports the lag; it is unknown after some deletions (and on Redis 6),
            # but every entry in a queue stream is either undelivered or pending (an
            # acknowledged entry is deleted), so it is the rest.
            lag = group.get("lag") if group is not None else None
            lag = int(lag) if lag is not None else length - pending
            found.append(StreamStats(queue, band, int(length), lag, pending))
        return found

    async def set_pending_updates(self, versions: dict[str, int]) -> None:
        if versions:
            async with _translated("hset"):
                # The marks and the hash's edit count change together (one key: one slot).
                pipe = self.client.pipeline(transaction=True)
                pipe.hset(self.keys.pending_updates(), mapping=versions)  # type: ignore[arg-type]
                pipe.hincrby(self.keys.pending_updates(), EDITS_FIELD, 1)
                await pipe.execute()

    async def get_pending_updates(self, keys: Collection[str] | None = None) -> dict[str, int]:
        """The marks are read whole only when the hash changed since this bus last read it
        (its edit count, or its length for marks of a version without the count): the
        leader asks before every fire, for every job of the tick, and the hash rarely
        changes (two O(1) reads, not a thousand fields)."""
        name = self.keys.pending_updates()
        async with _translated("hget"):
            pipe = self.client.pipeline(transaction=False)
            pipe.hget(name, EDITS_FIELD)
            pipe.hlen(name)
            edits, length = await pipe.execute()
            seen = (edits, length)
            if seen != self._marks_seen:
                raw = await self.client.hgetall(name)
                edits = raw.pop(EDITS_FIELD.encode(), None)
                self._marks = {_text(k): int(v) for k, v in raw.items()}
                # (As read with the marks: a newer edit count makes the next call read again.)
                self._marks_seen = (edits, len(raw) + (edits is not None))
        if keys is None:
            return dict(self._marks)
        return {k: self._marks[k] for k in keys if k in self._marks}

    async def clear_pending_update(self, key: str, version: int) -> bool:
        async with _translated("clear pending"):
            removed = await self._clear_pending(
                keys=[self.keys.pending_updates()], args=[key, str(version)]
            )
        return bool(removed)

    async def publish_event(self, event: Event) -> None:
        async with _translated("publish event"):
            await self.client.publish(self.keys.events_channel(), event.encode())

    async def subscribe(self) -> AsyncIterator[Event]:
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        try:
            async with _translated("subscribe"):
                await pubsub.subscribe(self.keys.events_channel())
            while not self._closed:
                async with _translated("events"):
                    message = await pubsub.get_message(timeout=1.0)
                if message is None or message.get("type") != "message":
                    continue
                try:
                    yield Event.decode(message["data"])
                except EnvelopeError as exc:
                    logger.warning(
                        "dropped an undecodable event: %s", exc, extra={"action": "bus.bad_event"}
                    )
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call]


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
        async with _translated(what):
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
        entry = _text(entry_id)
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
        async with _translated("dead letter"):
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
        async with _translated("ack"):
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
        async with _translated("requeue"):
            await pipe.execute()


def _by_stream(reply: Any) -> list[tuple[str, list[tuple[bytes, dict[bytes, bytes]]]]]:
    """XREADGROUP replies are a list (RESP2) or a dict (RESP3) of stream → entries."""
    if not reply:
        return []
    items = reply.items() if isinstance(reply, dict) else reply
    return [(_text(stream), entries) for stream, entries in items]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
