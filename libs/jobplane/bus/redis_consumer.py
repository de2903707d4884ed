"""A worker's consumer of the Redis Streams bus: batched reads in priority order, claims'
entries acknowledged and deleted, entries of unknown jobs put back or forwarded, undecodable
ones dead-lettered."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from redis.exceptions import ResponseError

from jobplane.bus.abc import Delivery
from jobplane.bus.envelope import Envelope, undecodable
from jobplane.bus.keys import GROUP
from jobplane.bus.redis_calls import as_text, hash_tag, translated
from jobplane.errors import EnvelopeError

if TYPE_CHECKING:
    from jobplane.bus.redis import RedisBus

# The bus's logger, as before the consumer had a module of its own (operators filter on it).
logger = logging.getLogger("jobplane.bus.redis")

T = TypeVar("T")
#: Entries kept in a dead-letter stream (approximately: the oldest are trimmed).
DEAD_LETTER_MAXLEN = 10_000

# Put entries back at the end of their stream KEYS[1] (ARGV: the group, then pairs of entry id
# and data): each is copied only if this call acknowledged it, i.e. it was still pending (not
# moved or acknowledged since, here or by a consumer that reclaimed it), then deleted. In one
# script, so that no reader sees an entry twice, nor none.
REQUEUE_LUA = """
local moved = 0
for i = 2, #ARGV, 2 do
    if redis.call('XACK', KEYS[1], ARGV[1], ARGV[i]) == 1 then
        redis.call('XADD', KEYS[1], '*', 'd', ARGV[i + 1])
        moved = moved + 1
    end
    redis.call('XDEL', KEYS[1], ARGV[i])
end
return moved
"""

# The first pass of a read over streams that share a hash tag, in one round trip: KEYS are the
# streams, highest priority first; ARGV the group, the consumer and the most entries to take.
# Each stream is read (not blocking) only for what the streams before it left: the same
# XREADGROUP calls, in the same order, as one call per stream from the client. Returns
# {{stream, entries}, ...} with entries as XREADGROUP gives them ({id, {field, value, ...}}),
# then the error that stopped the reads, if one did. (Not raised: what the streams before it
# handed over is returned, not left pending until reclaimed.)
READ_FIRST_LUA = """
local out = {}
local left = tonumber(ARGV[3])
for i = 1, #KEYS do
    if left <= 0 then break end
    local reply = redis.pcall('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', left,
                              'STREAMS', KEYS[i], '>')
    if type(reply) == 'table' and reply.err then
        return {out, reply.err}
    end
    if reply and #reply[1][2] > 0 then
        out[#out + 1] = {KEYS[i], reply[1][2]}
        left = left - #reply[1][2]
    end
end
return {out}
"""


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
        # The streams in runs that share a hash tag (the worker's, then each queue's bands):
        # the first pass reads each run in one script call, as Redis Cluster allows.
        self._runs: list[list[str]] = []
        for key in self.streams:
            if self._runs and hash_tag(self._runs[-1][0]) == hash_tag(key):
                self._runs[-1].append(key)
            else:
                self._runs.append([key])
        self._read_first = self.client.register_script(READ_FIRST_LUA)
        self._requeue = self.client.register_script(REQUEUE_LUA)
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
                if not _group_gone(str(exc)):
                    raise
                await self._recreate_groups(what)
                return await op()

    async def _recreate_groups(self, what: str) -> None:
        logger.warning(
            "consumer group missing on %s; recreating it",
            what,
            extra={"action": "bus.nogroup"},
        )
        await self._ensure_groups()

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
        """Non-blocking reads, stream by stream in priority order, never more than ``count``:
        one script call per run of streams that share a hash tag (a queue's three bands are
        one round trip, not three; a worker on one queue makes two, not four)."""
        out: list[Delivery] = []
        for run in self._runs:
            for attempt in range(2):
                remaining = count - len(out)
                if remaining <= 0:
                    return out
                async with translated("xreadgroup"):
                    if not self._groups_ready:
                        await self._ensure_groups()
                    reply = await self._read_first(keys=run, args=[GROUP, self.name, remaining])
                for stream, entries in reply[0] or []:
                    out += await self._deliveries([(stream, _entries(entries))])
                error = as_text(reply[1]) if len(reply) > 1 and reply[1] else None
                if error is None:
                    break
                if not _group_gone(error) or attempt:
                    async with translated("xreadgroup"):  # (a reply as any other)
                        raise ResponseError(error)
                async with translated("xreadgroup"):
                    await self._recreate_groups("xreadgroup")
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
                # Its fields, as JSON, are what the dead letter keeps (an empty body said
                # nothing of what the entry was).
                raw = _fields_as_json(fields or {})
                raise EnvelopeError("entry has no 'd' field (its fields are kept as JSON)")
            envelope = Envelope.decode(raw)
        except Exception as exc:
            # Whatever a bad body makes the decode raise, the entry goes to the dead letters:
            # raised, it would stop this worker, stay pending, and stop every worker that
            # reclaims it in turn. (Its instance is not lost: the store is the truth, and the
            # scheduler's sweep republishes an Enqueued instance whose message is gone.)
            await self._dead_letter(stream, entry, raw or b"", exc)
            return None
        queue = self.bus.keys.queue_of(stream)
        return Delivery(stream, entry, envelope, times_delivered=count, queue=queue)

    async def _dead_letter(self, stream: str, entry_id: str, raw: bytes, exc: Exception) -> None:
        dead = self._dead_of[stream]
        error = undecodable(exc)
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
            # An error that is not an EnvelopeError is a case the decode missed: where.
            exc_info=None if isinstance(exc, EnvelopeError) else exc,
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
        by_stream: dict[str, list[Delivery]] = {}
        for d in deliveries:
            by_stream.setdefault(d.stream, []).append(d)
        if not by_stream:
            return
        # (The pipeline as a context: see Appender's, which carries scripts too.)
        async with translated("requeue"), self.client.pipeline(transaction=False) as pipe:
            for stream, moved in by_stream.items():
                args: list[str | bytes] = [GROUP]
                for d in moved:
                    args += [d.entry_id, d.envelope.encode()]
                await self._requeue(keys=[stream], args=args, client=pipe)
            await pipe.execute()

    async def forward(self, deliveries: Sequence[Delivery], worker_id: str) -> None:
        """Copy each entry to ``worker_id``'s stream, then take the original away; a copy
        whose original was no longer pending (moved or acknowledged meanwhile, by this
        consumer or another that reclaimed it) is deleted again. Copied each time, an entry
        held through a reclaim was handed on twice. The copy comes first: a crash in between
        duplicates the message (harmless: the claim is a compare-and-set) but never loses it.
        In steps (the target's stream is in another hash slot than the original's)."""
        if not deliveries:
            return
        target = self.bus.keys.worker_stream(worker_id)
        async with translated("forward"):
            pipe = self.client.pipeline(transaction=False)
            for d in deliveries:
                pipe.xadd(target, {"d": d.envelope.encode()})
            copies = await pipe.execute()
            pipe = self.client.pipeline(transaction=False)
            for d in deliveries:
                pipe.xack(d.stream, GROUP, d.entry_id)  # 1 for the one mover that held it
                pipe.xdel(d.stream, d.entry_id)
            taken = (await pipe.execute())[::2]
            stale = [copy for copy, acked in zip(copies, taken, strict=True) if not acked]
            if stale:
                await self.client.xdel(target, *stale)


def _fields_as_json(fields: dict[bytes, bytes]) -> bytes:
    """An entry's fields as one JSON object, bytes that are not UTF-8 escaped."""

    def text(value: bytes) -> str:
        return value.decode("utf-8", errors="backslashreplace")

    return json.dumps({text(k): text(v) for k, v in fields.items()}).encode()


def _group_gone(error: str) -> bool:
    """NOGROUP: the stream or its group is gone; UNBLOCKED: it vanished while a read blocked
    on it (FLUSHALL, restart). Both: recreate the groups, read again."""
    return "NOGROUP" in error or "UNBLOCKED" in error


def _entries(raw: Any) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """A script's XREADGROUP entries ({id, {field, value, ...}}, as Redis gives them to Lua)
    as redis-py parses a reply of its own: (id, {field: value})."""
    return [(entry_id, dict(zip(flat[::2], flat[1::2], strict=True))) for entry_id, flat in raw]


def _by_stream(reply: Any) -> list[tuple[str, list[tuple[bytes, dict[bytes, bytes]]]]]:
    """XREADGROUP replies are a list (RESP2) or a dict (RESP3) of stream → entries."""
    if not reply:
        return []
    items = reply.items() if isinstance(reply, dict) else reply
    return [(as_text(stream), entries) for stream, entries in items]
