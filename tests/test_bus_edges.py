"""The bus beyond its contract: the Redis bus's own edges (a flush, a vanished stream or band, a
reader killed mid-read, an unreachable server) and the envelope's encoding."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import textwrap
import uuid

import pytest

from jobplane.bus.abc import Bus
from jobplane.bus.envelope import Envelope
from jobplane.bus.factory import open_bus
from jobplane.bus.keys import band_of
from jobplane.bus.redis import RedisBus
from jobplane.errors import BusUnavailableError, EnvelopeError
from tests.bus_helpers import envelope


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
