"""The Redis Streams bus (production).

Entries carry one field, ``d``: the envelope's JSON bytes. Queue streams are never trimmed
(an unread entry must not vanish); entries are deleted when acknowledged, which the worker does
once its claim has committed in Postgres.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Collection, Sequence
from contextlib import aclosing
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, ResponseError

from jobplane.bus.abc import BusEpoch, DeadLetter, StreamStats
from jobplane.bus.envelope import Envelope, Event
from jobplane.bus.keys import BANDS, GROUP, Keys
from jobplane.bus.redis_append import Appender
from jobplane.bus.redis_calls import as_text, translated
from jobplane.bus.redis_consumer import RedisConsumer
from jobplane.errors import BusUnavailableError, ConfigurationError, EnvelopeError

logger = logging.getLogger(__name__)

#: Entries read per XRANGE call when looking for messages still in a stream.
XRANGE_PAGE = 1000

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
# Delete consumer ARGV[2] of group ARGV[1] on stream KEYS[1] unless entries are pending on it
# (DELCONSUMER drops them from the group's pending list: nobody would reclaim them); at once,
# so that none is handed to it in between. 1: deleted or absent, 0: kept.
FORGET_CONSUMER_LUA = """
local ok, pending = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2])
if not ok then return 1 end
if #pending > 0 then return 0 end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
return 1
"""
# Acknowledge and delete entries ARGV[2..] of a worker's own stream KEYS[1] (group ARGV[1]),
# then delete the stream if that emptied it and no worker ever made its group there: the
# stream of a worker id that never started (a trigger pinned to a mistyped id) is otherwise
# left for good, as forgetting stopped workers only reaches those that registered. At once,
# so a worker that starts in between (and makes its group) keeps its stream. Returns how
# many entries were deleted.
DROP_PINNED_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
pcall(redis.call, 'XACK', KEYS[1], ARGV[1], unpack(ARGV, 2))
local deleted = redis.call('XDEL', KEYS[1], unpack(ARGV, 2))
if redis.call('XLEN', KEYS[1]) == 0 and #redis.call('XINFO', 'GROUPS', KEYS[1]) == 0 then
    redis.call('DEL', KEYS[1])
end
return deleted
"""
#: Entries dropped per script call (Lua's ``unpack`` takes a few thousand at most).
DROP_CHUNK = 1000


class RedisBus:
    """Redis Streams bus. Closes ``client`` on :meth:`close` only if ``owns_client``."""

    def __init__(self, client: aioredis.Redis, keys: Keys, *, owns_client: bool) -> None:
        self.client = client
        self.keys = keys
        self._owns_client = owns_client
        self._closed = False
        self._clear_pending = client.register_script(CLEAR_PENDING_LUA)
        self._appender = Appender(client, client.register_script(APPEND_LUA))
        self._forget_consumer = client.register_script(FORGET_CONSUMER_LUA)
        self._drop_pinned = client.register_script(DROP_PINNED_LUA)
        #: The pending-update marks as last read whole, and the hash's (edit count, length)
        #: then (see :meth:`get_pending_updates`).
        self._marks: dict[str, int] = {}
        self._marks_seen: tuple[Any, int] | None = None
        #: Per stream, the furthest entry in which :meth:`queued` last found one it looked for.
        self._looked: dict[str, str] = {}

    async def close(self) -> None:
        self._closed = True
        if self._owns_client:
            await self.client.aclose()

    async def ping(self) -> None:
        # Refused at the connection's set-up: a database index the server does not have
        # (``redis://host/99``), a wrong or missing password. A setting to fix, said in one
        # line at once: it was a traceback, or (a password: a connection error to redis-py)
        # an outage waited out until the start-up timeout.
        refused: Exception | None = None
        try:
            async with translated("ping"):
                try:
                    await self.client.ping()
                except AuthenticationError as exc:
                    refused = exc
        except ResponseError as exc:  # (translated lets a refusal that is not "not now" by)
            refused = exc
        if refused is not None:
            raise ConfigurationError(
                f"Redis refuses this connection: {refused} (see JOBPLANE_REDIS_URL)"
            ) from refused

    async def epoch(self) -> BusEpoch:
        # A restart changes the run_id; a FLUSHALL/FLUSHDB on a live server does not, but it
        # deletes the marker key.
        async with translated("epoch"):
            pipe = self.client.pipeline(transaction=False)
            pipe.info("server")
            pipe.get(self.keys.epoch_marker())
            info, marker = await pipe.execute()
        return BusEpoch(str(info["run_id"]), None if marker is None else as_text(marker))

    async def mark_epoch(self) -> BusEpoch:
        async with translated("mark epoch"):
            await self.client.set(self.keys.epoch_marker(), uuid.uuid4().hex, nx=True)
        return await self.epoch()

    async def publish(self, envelopes: Sequence[tuple[str, Envelope]]) -> None:
        await self.publish_encoded(self.encode(envelopes))

    def encode(self, envelopes: Sequence[tuple[str, Envelope]]) -> list[tuple[str, bytes]]:
        entries = [(self.keys.stream_of(queue, e), e.encode()) for queue, e in envelopes]
        # Several are appended by script calls: packed now too (see redis_append).
        return entries if len(entries) < 2 else self._appender.pack(entries)

    async def publish_encoded(self, entries: Sequence[tuple[str, bytes]]) -> None:
        if not entries:
            return
        async with translated("publish"):
            if len(entries) == 1:
                # A single trigger's message: the command alone, without a pipeline's
                # bookkeeping (a quarter of the publish's CPU; the same one round trip).
                [(key, raw)] = entries
                await self.client.xadd(key, {"d": raw})
                return
            # Several: appended by a script, one command for up to PUBLISH_CHUNK entries of
            # one hash slot, rather than a pipeline of one XADD each, whose replies redis-py
            # parses one by one (a cron tick of 1,000 instances spent 44 ms of the leader's CPU
            # in the pipeline).
            await self._appender.append(entries)

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
            furthest: str | None = None
            # Read until every wanted one is found: a few pages on from the furthest entry the
            # last look at this stream found, then from the start up to there, then on to the
            # end: the whole stream at most, once (one really lost). The leader's sweep walks
            # the unclaimed instances a page at a time in publication order: the next ones
            # asked for lie just past the furthest found, or back at the start when its walk
            # starts again. From the start each time, a look read the whole walk so far.
            probe = len(wanted) // XRANGE_PAGE + 2
            entries = self._entries_from(key, self._looked.get(key), probe)
            async with aclosing(entries):
                async for entry_id, instance_id in entries:
                    if instance_id in missing and as_text(entry_id) not in stuck:
                        missing.discard(instance_id)
                        if furthest is None or _later(as_text(entry_id), furthest):
                            furthest = as_text(entry_id)
                        if not missing:
                            break
            if furthest is not None:
                self._looked[key] = furthest
            found |= wanted - missing
        return found

    async def _entries_from(
        self, key: str, start: str | None, pages: int
    ) -> AsyncGenerator[tuple[Any, uuid.UUID], None]:
        """As :meth:`_entries`: from the entry ``start`` (or the first after it) at most
        ``pages`` pages, then from the first entry up to ``start``, then on from the first
        part to the end: every entry of the stream. A worker's put-back appends its copy before
        it deletes the original, and every part reads forward, so an entry moved while this
        reads is met once or twice, never missed (the copy lies past everything read before
        the move, and the last part reads to the end)."""
        if start is None:
            async with aclosing(self._entries(key)) as every:
                async for entry in every:
                    yield entry
            return
        last: str | None = None  # the last entry the first part read
        async with aclosing(self._entries(key, start, pages=pages)) as near:
            async for entry_id, instance_id in near:
                last = as_text(entry_id)
                yield entry_id, instance_id
        async with aclosing(self._entries(key, "-", "(" + start)) as head:
            async for entry in head:
                yield entry
        async with aclosing(self._entries(key, start if last is None else "(" + last)) as rest:
            async for entry in rest:
                yield entry

    async def _entries(
        self, key: str, start: str = "-", end: str = "+", *, pages: int | None = None
    ) -> AsyncGenerator[tuple[Any, uuid.UUID], None]:
        """(entry id, instance id) of every decodable entry of the stream ``key`` from
        ``start`` to ``end`` (XRANGE bounds), oldest first, read a page at a time (at most
        ``pages`` pages; an undecodable entry is the reader's to dead-letter)."""
        read = 0
        while pages is None or read < pages:
            async with translated("xrange"):
                page: Any = await self.client.xrange(key, min=start, max=end, count=XRANGE_PAGE)
            read += 1
            for entry_id, fields in page or []:
                try:
                    yield entry_id, Envelope.decode(fields.get(b"d", b"")).instance_id
                except EnvelopeError:
                    continue
            if len(page or []) < XRANGE_PAGE:
                return
            start = "(" + as_text(page[-1][0])

    async def forget_worker(self, worker_id: str, queues: Sequence[str]) -> bool:
        own = self.keys.worker_stream(worker_id)
        async with translated("forget worker"):
            # One round trip; a script call per stream, each touching one key (Redis
            # Cluster's rule), then the worker's own keys (one hash tag).
            pipe = self.client.pipeline(transaction=False)
            for key in (k for q in queues for k in self.keys.queue_streams(q)):
                await self._forget_consumer(keys=[key], args=[GROUP, worker_id], client=pipe)
            pipe.unlink(own, self.keys.worker_dead_letter(worker_id))
            *forgotten, _ = await pipe.execute()
        self._looked.pop(own, None)
        return all(forgotten)

    async def drop_pinned(self, worker_id: str, instance_ids: Collection[uuid.UUID]) -> int:
        key, wanted = self.keys.worker_stream(worker_id), set(instance_ids)
        if not wanted:
            return 0
        doomed = [e async for e, instance_id in self._entries(key) if instance_id in wanted]
        deleted = 0
        async with translated("xdel"):
            for start in range(0, len(doomed), DROP_CHUNK):
                chunk = doomed[start : start + DROP_CHUNK]
                deleted += int(await self._drop_pinned(keys=[key], args=[GROUP, *chunk]))
        return deleted

    async def _stuck(self, key: str, idle_ms: int) -> set[str]:
        """Ids of ``key``'s entries delivered at least ``idle_ms`` ago and not acknowledged."""
        stuck: set[str] = set()
        start = "-"
        while True:
            try:
                async with translated("xpending"):
                    page: Any = await self.client.xpending_range(
                        key, GROUP, min=start, max="+", count=XRANGE_PAGE, idle=idle_ms
                    )
            except ResponseError:
                return stuck  # no such stream or group yet: nothing delivered
            stuck.update(as_text(p["message_id"]) for p in page or [])
            if len(page or []) < XRANGE_PAGE:
                return stuck
            start = "(" + as_text(page[-1]["message_id"])

    def consumer(self, worker_id: str, queues: Sequence[str]) -> RedisConsumer:
        return RedisConsumer(self, worker_id, queues)

    async def dead_letters(self, queue: str, count: int = 100) -> list[DeadLetter]:
        async with translated("xrange"):
            entries: Any = await self.client.xrange(self.keys.dead_letter(queue), count=count)
        out = []
        for _, fields in entries or []:
            out.append(
                DeadLetter(
                    stream=as_text(fields.get(b"stream", b"")),
                    entry_id=as_text(fields.get(b"id", b"")),
                    raw=bytes(fields.get(b"d", b"")),
                    error=as_text(fields.get(b"error", b"")),
                )
            )
        return out

    async def stream_lengths(self, queue: str) -> dict[str, int]:
        keys = self.keys.queue_streams(queue)
        async with translated("xlen"):
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.xlen(key)
            lengths = await pipe.execute()
        return dict(zip(keys, lengths, strict=True))

    async def stream_stats(self, queues: Collection[str]) -> list[StreamStats]:
        streams = [(q, band) for q in sorted(set(queues)) for _, band in BANDS]
        async with translated("xinfo"):
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
            group = next((g for g in groups if as_text(g["name"]) == GROUP), None)
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
            async with translated("hset"):
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
        async with translated("hget"):
            pipe = self.client.pipeline(transaction=False)
            pipe.hget(name, EDITS_FIELD)
            pipe.hlen(name)
            edits, length = await pipe.execute()
            seen = (edits, length)
            if seen != self._marks_seen:
                raw = await self.client.hgetall(name)
                edits = raw.pop(EDITS_FIELD.encode(), None)
                self._marks = {as_text(k): int(v) for k, v in raw.items()}
                # (As read with the marks: a newer edit count makes the next call read again.)
                self._marks_seen = (edits, len(raw) + (edits is not None))
        if keys is None:
            return dict(self._marks)
        return {k: self._marks[k] for k in keys if k in self._marks}

    async def clear_pending_update(self, key: str, version: int) -> bool:
        async with translated("clear pending"):
            removed = await self._clear_pending(
                keys=[self.keys.pending_updates()], args=[key, str(version)]
            )
        return bool(removed)

    async def publish_event(self, event: Event) -> None:
        async with translated("publish event"):
            await self.client.publish(self.keys.events_channel(), event.encode())

    async def subscribe(self) -> AsyncIterator[Event]:
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        try:
            async with translated("subscribe"):
                await pubsub.subscribe(self.keys.events_channel())
            while not self._closed:
                async with translated("events"):
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


def _later(entry_id: str, than: str) -> bool:
    """Whether stream entry ``entry_id`` comes after ``than`` (ids are ``<ms>-<seq>``)."""
    ms, _, seq = entry_id.partition("-")
    other_ms, _, other_seq = than.partition("-")
    return (int(ms), int(seq or 0)) > (int(other_ms), int(other_seq or 0))
