"""Many stream entries appended by script calls packed ahead of their send (Redis).

The leader encodes a cron tick's messages before the tick (``Bus.encode``) so that, at the
tick, only their append is left. For a tick of 1,000 entries that append was one script call,
which redis-py packed when it was made: 1.07 ms of the 3.1 ms the call took (its send and the
script's run 1.5 ms, the client's own steps the rest; medians of 30, 2026-12-07). The calls are
now packed with the encoding, and the append sends the packed calls on one of the client's
connections and reads their replies, nothing more.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError

from jobplane.bus.redis_calls import hash_tag

#: Entries appended by one call of the script (Redis runs a script alone: ~1 ms per 1,000).
PUBLISH_CHUNK = 1000


class AppendCall(NamedTuple):
    """One call of the append script: its keys (streams), their entries' data, and, once
    packed, the call as it goes on the wire (``EVALSHA``)."""

    keys: list[str]
    data: list[bytes]
    packed: list[bytes]


class PackedEntries(list[tuple[str, bytes]]):
    """Entries as :meth:`~jobplane.bus.abc.Bus.encode` gives them (a list of (stream,
    encoding)), with the script calls that append them packed already."""

    def __init__(self, entries: Sequence[tuple[str, bytes]], calls: list[AppendCall]) -> None:
        super().__init__(entries)
        self.calls = calls


def append_calls(entries: Sequence[tuple[str, bytes]]) -> list[tuple[list[str], list[bytes]]]:
    """The script calls that append ``entries``: up to PUBLISH_CHUNK entries each, whose
    keys share a hash tag (a queue's streams, or a worker's), as Redis Cluster requires;
    each stream's entries in the order given."""
    slots: dict[str, tuple[list[str], list[bytes]]] = {}
    for key, raw in entries:
        keys, data = slots.setdefault(hash_tag(key), ([], []))
        keys.append(key)
        data.append(raw)
    return [
        (keys[i : i + PUBLISH_CHUNK], data[i : i + PUBLISH_CHUNK])
        for keys, data in slots.values()
        for i in range(0, len(keys), PUBLISH_CHUNK)
    ]


class Appender:
    """Appends entries with ``script`` (``KEYS[i]`` gets ``ARGV[i]``) on ``client``."""

    def __init__(self, client: aioredis.Redis, script: AsyncScript) -> None:
        self.client = client
        self.script = script
        #: A connection object never connected, for its packing of commands (the client's
        #: own encoding and protocol).
        self._packer: aioredis.Connection | None = None

    def pack(self, entries: Sequence[tuple[str, bytes]]) -> PackedEntries:
        """``entries`` with their script calls packed."""
        if self._packer is None:
            self._packer = self.client.connection_pool.make_connection()  # type: ignore[no-untyped-call]
        sha = self.script.sha
        calls = [
            AppendCall(
                keys, data, self._packer.pack_command("EVALSHA", sha, len(keys), *keys, *data)
            )
            for keys, data in append_calls(entries)
        ]
        return PackedEntries(entries, calls)

    async def append(self, entries: Sequence[tuple[str, bytes]]) -> None:
        """Append ``entries`` (more than one): their packed calls if :meth:`pack` made them,
        else calls made now."""
        if isinstance(entries, PackedEntries):
            await self._send_packed(entries.calls)
            return
        calls = append_calls(entries)
        if len(calls) == 1:
            [(keys, data)] = calls
            await self.script(keys=keys, args=data)
            return
        # (As a context: redis-py loads a pipeline's scripts before the part of execute() that
        # gives its connection back; failed or cancelled there, the connection stayed taken.)
        async with self.client.pipeline(transaction=False) as pipe:
            for keys, data in calls:
                await self.script(keys=keys, args=data, client=pipe)
            await pipe.execute()

    async def _send_packed(self, calls: list[AppendCall]) -> None:
        """Send the packed ``calls`` at once on one connection and read their replies. A call
        the server does not know the script of yet (``NOSCRIPT``: a new or flushed server) is
        made again through the script object, which loads it; so is each call whose reply a
        failed connection lost (redis-py's own calls retry that), as it may or may not have
        run, and every call after the first made again, to keep each stream's order (a second
        entry for an instance is harmless: the claim takes it once)."""
        pool = self.client.connection_pool
        conn = await pool.get_connection()  # type: ignore[no-untyped-call]
        # The calls from the first one not known to have run: made again, in order (a
        # stream's later chunk must not land before its earlier one), those that did run
        # after it included.
        again, i = len(calls), 0
        try:
            await conn.send_packed_command([part for call in calls for part in call.packed])
            for i in range(len(calls)):
                try:
                    await conn.read_response()
                except NoScriptError:
                    again = min(again, i)
        except (RedisConnectionError, RedisTimeoutError, OSError):
            await conn.disconnect()
            again = min(again, i)
        except BaseException:
            # (A reply not read, a cancel mid-way: the connection's state is unknown.)
            await conn.disconnect()
            raise
        finally:
            await pool.release(conn)
        for call in calls[again:]:
            await self.script(keys=call.keys, args=call.data)
