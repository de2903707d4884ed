"""The bus beyond its contract: the Redis bus's own edges (a flush, a vanished stream or band, a
reader killed mid-read, an unreachable server, appends packed ahead meeting a server without
their script or a lost reply) and the envelope's encoding."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import textwrap
import uuid
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from jobplane.bus.abc import Bus
from jobplane.bus.envelope import Envelope
from jobplane.bus.factory import open_bus
from jobplane.bus.keys import band_of
from jobplane.bus.redis import RedisBus
from jobplane.bus.redis_append import PackedEntries
from jobplane.errors import BusUnavailableError, EnvelopeError
from tests.bus_helpers import envelope
from tests.cli_helpers import free_port
from tests.fixtures.private_servers import private_redis


async def test_a_flush_shows_in_the_epoch(redis_bus: Bus, redis_url: str) -> None:
    assert isinstance(redis_bus, RedisBus)
    marked = await redis_bus.mark_epoch()
    # A FLUSHALL deletes every key; here only this test's own marker key is deleted.
    await redis_bus.client.delete(redis_bus.keys.epoch_marker())
    flushed = await redis_bus.epoch()
    assert flushed.run_id == marked.run_id and flushed.marker is None


async def test_group_is_recreated_when_its_stream_vanished(redis_bus: Bus) -> None:
    assert isinstance(redis_bus, RedisBus)
    consumer = redis_bus.consumer("w1", ["default"])
    await redis_bus.publish([("default", envelope())])
    await consumer.ack(await consumer.read(1, 50))
    # Redis restarted empty, or someone deleted the stream: the group is gone with it.
    await redis_bus.client.delete(*redis_bus.keys.queue_streams("default"))
    sent = envelope()
    await redis_bus.publish([("default", sent)])
    got = await consumer.read(1, 100)
    assert got == [] or [d.envelope for d in got] == [sent]
    # The recreated group starts at 0: nothing published after the loss is missed.
    if not got:
        got = await consumer.read(1, 100)
    assert [d.envelope for d in got] == [sent]


async def test_a_band_that_vanished_does_not_hold_back_what_the_bands_before_it_gave(
    redis_bus: Bus,
) -> None:
    # The first pass reads a queue's bands in one script call. One band's stream deleted
    # behind the consumer's back (its group with it): the entries of the band read before it
    # are still handed over, not left pending until a reclaim, and the group comes back.
    assert isinstance(redis_bus, RedisBus)
    consumer = redis_bus.consumer("w1", ["default"])
    await consumer.read(1, 10)  # the groups exist
    high = envelope(8)
    await redis_bus.publish([("default", high)])
    await redis_bus.client.delete(redis_bus.keys.queue_stream("default", band_of(4)))
    assert [d.envelope for d in await consumer.read(5, 10)] == [high]
    mid = envelope(4)
    await redis_bus.publish([("default", mid)])
    assert [d.envelope for d in await consumer.read(5, 10)] == [mid]


async def test_entry_read_by_a_killed_process_is_reclaimed(
    redis_url: str, redis_prefix: str
) -> None:
    """A real consumer process reads an entry and is SIGKILLed before acking it."""
    bus = open_bus(redis_url, redis_prefix)
    try:
        sent = envelope()
        await bus.publish([("default", sent)])
        script = textwrap.dedent(
            f"""
            import asyncio, sys, time
            from jobplane.bus.factory import open_bus
            async def main():
                bus = open_bus({redis_url!r}, {redis_prefix!r})
                got = await bus.consumer("doomed", ["default"]).read(1, 2000)
                print("READ", len(got), flush=True)
                time.sleep(60)
            asyncio.run(main())
            """
        )
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE
        )
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 30)
            assert line.decode().strip() == "READ 1"
        finally:
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
        survivor = bus.consumer("survivor", ["default"])
        assert await survivor.read(1, 50) == []  # not delivered twice to new readers
        await asyncio.sleep(0.1)
        got = await survivor.reclaim(50, 10)
        assert [d.envelope for d in got] == [sent]
    finally:
        await bus.close()


async def test_unreachable_redis_is_a_clear_error() -> None:
    bus = open_bus("redis://127.0.0.1:1/0")
    try:
        with pytest.raises(BusUnavailableError, match="Redis unavailable"):
            await bus.ping()
        with pytest.raises(BusUnavailableError, match="Redis unavailable"):
            await bus.stream_stats(["default"])
    finally:
        await bus.close()


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"[]",
        b"{}",
        b'{"v": 2, "kind": "run", "id": "x", "job": "j", "prio": 1}',
        b'{"v": 1, "kind": "run", "id": "not-a-uuid", "job": "j", "prio": 1}',
        # Fixed ids, not uuid4(): a test id must be the same in every process collecting it.
        b'{"v": 1, "kind": "fly", "id": "00000000-0000-4000-8000-000000000001", "job": "j", '
        b'"prio": 1}',
        b'{"v": 1, "kind": "run", "id": "00000000-0000-4000-8000-000000000002", "job": 3, '
        b'"prio": 1}',
    ],
)
def test_envelope_decode_errors(raw: bytes) -> None:
    with pytest.raises(EnvelopeError):
        Envelope.decode(raw)


def test_envelope_round_trip() -> None:
    for sent in (envelope(), envelope(pinned="w-9")):
        assert Envelope.decode(sent.encode()) == sent


@pytest.mark.parametrize(
    ("key", "pinned", "trace"),
    [
        ("plain", None, None),
        ('quo"te\\back\nline\u0001', "w-\u00e9t\u00e9", "00-abc-01"),
        ("\u96ea-\U0001f600", None, "tp"),
    ],
)
def test_an_envelope_encodes_as_json_dumps_of_its_fields(
    key: str, pinned: str | None, trace: str | None
) -> None:
    """The encoder writes its fields out by hand: the bytes are exactly the compact
    ``json.dumps`` of the same object (ASCII, escaped), and decode back to the envelope."""
    sent = Envelope(uuid.uuid4(), key, 7, pinned_worker=pinned, trace=trace)
    body: dict[str, object] = {
        "v": 1,
        "kind": "run",
        "id": str(sent.instance_id),
        "job": key,
        "prio": 7,
    }
    if pinned is not None:
        body["pin"] = pinned
    if trace is not None:
        body["tp"] = trace
    assert sent.encode() == json.dumps(body, separators=(",", ":")).encode()
    assert Envelope.decode(sent.encode()) == sent


async def _entries_of(bus: RedisBus, queue: str) -> list[uuid.UUID]:
    """The instance ids of the entries in ``queue``'s streams, each stream in order."""
    found: list[uuid.UUID] = []
    for stream in bus.keys.queue_streams(queue):
        found += _ids_in(await bus.client.xrange(stream))
    return found


def _ids_in(entries: Any) -> list[uuid.UUID]:
    """The instance ids of the entries XRANGE read."""
    return [Envelope.decode(fields[b"d"]).instance_id for _, fields in entries]


async def test_packed_appends_of_many_streams_keep_each_stream_s_order(redis_bus: Bus) -> None:
    """Several entries are appended by script calls packed with their encoding (the leader
    encodes a tick's messages before the tick): more than one call's worth, over two queues
    and a worker's stream, each stream's entries in the order given."""
    assert isinstance(redis_bus, RedisBus)
    sent = [("a", envelope(job=f"a{i}")) for i in range(1_500)]
    sent += [("b", envelope(priority=9)) for _ in range(10)]
    sent += [("a", envelope(pinned="w1")) for _ in range(3)]
    encoded = redis_bus.encode(sent)
    assert isinstance(encoded, PackedEntries) and len(encoded.calls) == 4  # (1,000 a call)
    await redis_bus.publish_encoded(encoded)
    assert await _entries_of(redis_bus, "a") == [e.instance_id for q, e in sent[:1_500]]
    assert await _entries_of(redis_bus, "b") == [e.instance_id for q, e in sent[1_500:1_510]]
    pinned = await redis_bus.client.xrange(redis_bus.keys.worker_stream("w1"))
    assert _ids_in(pinned) == [e.instance_id for _, e in sent[1_510:]]


async def test_packed_appends_load_the_script_a_server_does_not_know() -> None:
    """A server that lost its scripts (restarted, or ``SCRIPT FLUSH``) answers a packed call
    ``NOSCRIPT``: the call is made again through the script, which loads it; nothing is lost
    and nothing doubled."""
    port = free_port()
    with private_redis(port):
        bus = open_bus(f"redis://127.0.0.1:{port}/0", f"jptest-{uuid.uuid4().hex}")
        try:
            assert isinstance(bus, RedisBus)
            await _until_answers(bus)
            sent = [("q", envelope()) for _ in range(20)]
            encoded = bus.encode(sent)
            await bus.client.script_flush()
            await bus.publish_encoded(encoded)
            assert await _entries_of(bus, "q") == [e.instance_id for _, e in sent]
            # Known from then on: the next packed calls are taken as they are.
            again = [("q", envelope()) for _ in range(5)]
            await bus.publish_encoded(bus.encode(again))
            assert await _entries_of(bus, "q") == [e.instance_id for _, e in sent + again]
        finally:
            await bus.close()


def _lose_a_reply(monkeypatch: pytest.MonkeyPatch, reply: int) -> list[aioredis.Connection]:
    """Make the connection that sends packed appends fail at their ``reply``-th reply (from
    0), once; returns the connections it failed (the packed calls' only)."""
    send, read_response = aioredis.Connection.send_packed_command, aioredis.Connection.read_response
    appending: dict[aioredis.Connection, int] = {}
    dropped: list[aioredis.Connection] = []

    async def sending(conn: aioredis.Connection, command: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(command, list) and b"EVALSHA" in command[0]:
            appending[conn] = 0  # (the packed calls, not a connection's own handshake)
        return await send(conn, command, *args, **kwargs)

    async def lost_once(conn: aioredis.Connection, *args: Any, **kwargs: Any) -> Any:
        if conn in appending and not dropped:
            if appending[conn] == reply:
                dropped.append(conn)
                raise RedisConnectionError("connection lost (injected)")
            appending[conn] += 1
        return await read_response(conn, *args, **kwargs)

    monkeypatch.setattr(aioredis.Connection, "send_packed_command", sending)
    monkeypatch.setattr(aioredis.Connection, "read_response", lost_once)
    return dropped


async def test_packed_appends_whose_reply_is_lost_are_made_again(
    redis_bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection fails before the packed calls' replies are read (they may have run or
    not): the connection is closed rather than given back with replies unread, and the calls
    are made again through the script (redis-py retries those). An entry may then be there
    twice, which the claim makes harmless; none is missing."""
    assert isinstance(redis_bus, RedisBus)
    sent = [("q", envelope()) for _ in range(10)]
    encoded = redis_bus.encode(sent)
    dropped = _lose_a_reply(monkeypatch, 0)
    await redis_bus.publish_encoded(encoded)
    monkeypatch.undo()
    assert dropped
    found = await _entries_of(redis_bus, "q")
    assert set(found) == {e.instance_id for _, e in sent}
    assert len(found) == 20  # (the packed calls ran, and ran again)
    # The client goes on as before (no reply left unread on a connection given back).
    assert await redis_bus.client.ping()
    more = [("q", envelope()) for _ in range(3)]
    await redis_bus.publish_encoded(redis_bus.encode(more))
    assert (await _entries_of(redis_bus, "q"))[20:] == [e.instance_id for _, e in more]


async def test_packed_appends_whose_reply_came_are_not_made_again(
    redis_bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three calls (three queues); the connection fails at the second reply: the first call is
    known to have run and is not made again; the second and third are."""
    assert isinstance(redis_bus, RedisBus)
    sent = [(f"q{n}", envelope()) for n in range(3) for _ in range(4)]
    encoded = redis_bus.encode(sent)
    assert isinstance(encoded, PackedEntries) and len(encoded.calls) == 3
    dropped = _lose_a_reply(monkeypatch, 1)
    await redis_bus.publish_encoded(encoded)
    monkeypatch.undo()
    assert dropped
    for n, copies in ((0, 1), (1, 2), (2, 2)):
        mine = [e.instance_id for q, e in sent if q == f"q{n}"]
        assert await _entries_of(redis_bus, f"q{n}") == mine * copies


async def _until_answers(bus: Bus) -> None:
    for _ in range(100):
        try:
            await bus.ping()
            return
        except BusUnavailableError:
            await asyncio.sleep(0.05)
    await bus.ping()


async def test_dropping_the_last_pins_of_a_worker_that_never_started_deletes_its_stream(
    redis_bus: Bus,
) -> None:
    assert isinstance(redis_bus, RedisBus)
    # A trigger pinned to a worker id that never started (mistyped): the leader gives its
    # instances away and drops their entries; the stream itself must not stay for good.
    never = [envelope(pinned="never-started") for _ in range(3)]
    await redis_bus.publish([("default", e) for e in never])
    key = redis_bus.keys.worker_stream("never-started")
    assert await redis_bus.drop_pinned("never-started", [never[0].instance_id]) == 1
    assert await redis_bus.client.xlen(key) == 2  # others left: the stream stays
    assert await redis_bus.drop_pinned("never-started", [e.instance_id for e in never[1:]]) == 2
    assert not await redis_bus.client.exists(key)
    assert await redis_bus.drop_pinned("never-started", [never[0].instance_id]) == 0

    # A worker that read its stream has its group there: its emptied stream is kept (it may
    # still be running; forgetting stopped workers deletes it once it is gone for good).
    read = envelope(pinned="started")
    await redis_bus.publish([("default", read)])
    [delivered] = await redis_bus.consumer("started", ["default"]).read(1, 50)
    assert delivered.envelope == read
    assert await redis_bus.drop_pinned("started", [read.instance_id]) == 1
    started = redis_bus.keys.worker_stream("started")
    assert await redis_bus.client.exists(started)
    assert await redis_bus.client.xlen(started) == 0
    assert len(await redis_bus.client.xinfo_groups(started)) == 1


async def test_dropping_pins_goes_in_chunks(redis_bus: Bus) -> None:
    assert isinstance(redis_bus, RedisBus)
    many = [envelope(pinned="far") for _ in range(2_500)]
    await redis_bus.publish([("default", e) for e in many])
    assert await redis_bus.drop_pinned("far", [e.instance_id for e in many]) == 2_500
    assert not await redis_bus.client.exists(redis_bus.keys.worker_stream("far"))
