"""The bus contract, run against the Redis Streams bus and the in-process bus."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import pytest

from jobplane.bus.abc import Bus
from jobplane.bus.envelope import Envelope, Event, EventKind
from jobplane.bus.factory import open_bus
from jobplane.bus.keys import Keys, band_of
from jobplane.bus.redis import RedisBus
from jobplane.bus.redis_calls import hash_tag
from tests.bus_helpers import envelope, inject_raw, keys_of


async def test_queued_finds_unread_and_pending_entries_not_acked_ones(bus: Bus) -> None:
    unread, pending, acked = envelope(priority=1), envelope(), envelope()
    pinned, unsent = envelope(pinned="w9"), envelope()
    await bus.publish([("default", e) for e in (pending, acked)])
    consumer = bus.consumer("w1", ["default"])
    got = await consumer.read(10, 100)
    await consumer.ack([d for d in got if d.envelope == acked])
    await bus.publish([("default", unread), ("default", pinned)])
    await inject_raw(bus, Keys(keys_of(bus).prefix).queue_stream("default", 1), b"not json")
    asked = [("default", e) for e in (unread, pending, acked, pinned, unsent)]
    assert await bus.queued(asked) == {unread.instance_id, pending.instance_id, pinned.instance_id}
    assert await bus.queued([]) == set()
    await asyncio.sleep(0.1)  # `pending` has waited 100 ms for its consumer's ack
    stuck = await bus.queued(asked, stuck_after_ms=50)
    assert stuck == {unread.instance_id, pinned.instance_id}


async def test_queued_finds_entries_anywhere_in_a_long_stream(bus: Bus) -> None:
    # A backlog's stream spans pages of reads; an entry delivered long ago and unacknowledged
    # does not count, but a later copy of the same message does.
    sent = [envelope() for _ in range(2500)]
    await bus.publish([("default", e) for e in sent])
    asked = [sent[0], sent[1499], sent[-1], envelope()]
    assert await bus.queued([("default", e) for e in asked]) == {e.instance_id for e in asked[:3]}
    consumer = bus.consumer("w1", ["default"])
    [delivered] = await consumer.read(1, 100)  # sent[0], left unacknowledged
    await asyncio.sleep(0.1)
    assert await bus.queued([("default", sent[0])], stuck_after_ms=50) == set()
    await bus.publish([("default", sent[0])])  # republished: a fresh copy at the end
    assert await bus.queued([("default", sent[0])], stuck_after_ms=50) == {sent[0].instance_id}
    assert delivered.envelope == sent[0]


async def test_a_look_for_queued_messages_starts_where_the_last_one_found_its_last(
    redis_bus: Bus,
) -> None:
    """The leader asks, sweep after sweep, for the next instances unclaimed longest: the Redis
    bus reads a few pages on from the furthest entry its last look found, not from the
    stream's start each time; then from the start for those that lie before it (not the rest
    of the stream first); the whole stream once for one really gone."""
    assert isinstance(redis_bus, RedisBus)
    sent = [envelope() for _ in range(5000)]
    await redis_bus.publish([("default", e) for e in sent])
    pages = 0
    xrange = redis_bus.client.xrange

    async def counted(*args: object, **kwargs: object) -> object:
        nonlocal pages
        pages += 1
        return await xrange(*args, **kwargs)  # type: ignore[arg-type]

    redis_bus.client.xrange = counted  # type: ignore[method-assign,assignment]

    async def look(wanted: list[Envelope]) -> tuple[set[uuid.UUID], int]:
        nonlocal pages
        pages = 0
        found = await redis_bus.queued([("default", e) for e in wanted])
        return found, pages

    found, read = await look(sent[3000:3100])
    assert found == {e.instance_id for e in sent[3000:3100]} and read == 4  # from the start
    found, read = await look(sent[3100:3300])
    assert found == {e.instance_id for e in sent[3100:3300]} and read == 1  # on from there
    found, read = await look(sent[100:200])
    # Two pages on (to the end here), then from the start: not the rest of a longer stream.
    assert found == {e.instance_id for e in sent[100:200]} and read == 3
    found, read = await look([sent[5], sent[4999]])
    # Two pages on from sent[199], the start up to it (sent[5]), then on to the end.
    assert found == {sent[5].instance_id, sent[4999].instance_id} and read == 6
    gone = envelope()
    found, read = await look([gone])
    # Two pages on (one, at the end), the start up to there, then what came meanwhile (none).
    assert found == set() and read == 7


async def test_a_look_for_queued_messages_meets_an_entry_moved_while_it_reads(
    redis_bus: Bus,
) -> None:
    """A worker puts an entry back (a copy at the end, then the original deleted) while the
    bus reads the part of the stream before where its last look stopped: the original is gone
    before the read gets there and the copy lies past the end already read; it is still met,
    in what was appended meanwhile."""
    assert isinstance(redis_bus, RedisBus)
    sent = [envelope() for _ in range(3000)]
    await redis_bus.publish([("default", e) for e in sent])
    assert await redis_bus.queued([("default", sent[2500])]) == {sent[2500].instance_id}
    key = keys_of(redis_bus).stream_of("default", sent[10])
    first: Any = await redis_bus.client.xrange(key, count=11)
    original = first[-1][0]  # sent[10]'s entry
    xrange = redis_bus.client.xrange
    moved = False

    async def moving(name: str, min: str = "-", max: str = "+", count: int | None = None) -> object:
        nonlocal moved
        if max.startswith("(") and not moved:  # the read of the start, up to the last stop
            moved = True
            await redis_bus.client.xadd(key, {"d": sent[10].encode()})
            await redis_bus.client.xdel(key, original)
        return await xrange(name, min=min, max=max, count=count)

    redis_bus.client.xrange = moving  # type: ignore[method-assign,assignment]
    assert await redis_bus.queued([("default", sent[10])]) == {sent[10].instance_id}
    assert moved


async def test_publish_read_ack_round_trip(bus: Bus) -> None:
    sent = [envelope() for _ in range(3)]
    await bus.publish([("default", e) for e in sent])
    consumer = bus.consumer("w1", ["default"])
    got = await consumer.read(10, 100)
    assert [d.envelope for d in got] == sent
    await consumer.ack(got)
    assert await consumer.read(10, 50) == []
    assert await consumer.reclaim(0, 10) == []  # acked entries are gone, not pending
    assert sum((await bus.stream_lengths("default")).values()) == 0


async def test_a_large_batch_over_queues_bands_and_a_worker_arrives_whole_and_in_order(
    bus: Bus,
) -> None:
    """One publish of entries for several streams (two queues of one hash slot each, their
    bands, a worker's stream), more than one script call's worth for the main queue: every
    entry lands once, on its stream, in the order it was given."""
    many = [envelope(p) for p in (9, 5, 1) for _ in range(1100)]  # three bands, > 1 chunk
    pinned = [envelope(5, pinned="w1") for _ in range(3)]
    elsewhere = [envelope(5) for _ in range(4)]
    batch = [("default", e) for e in many] + [("default", e) for e in pinned]
    await bus.publish(batch + [("other", e) for e in elsewhere])
    consumer = bus.consumer("w1", ["default"])
    got: list[Envelope] = []
    while chunk := await consumer.read(1000, 50):
        got += [d.envelope for d in chunk]
        await consumer.ack(chunk)
    # Pinned first, then band by band, each in publication order.
    assert got == pinned + many
    other = bus.consumer("w2", ["other"])
    assert [d.envelope for d in await other.read(10, 50)] == elsewhere


def test_a_key_s_hash_tag_is_what_redis_cluster_hashes() -> None:
    assert hash_tag("jp:q:{default}:1") == "default"
    assert hash_tag("jp:w:{worker-1}") == "worker-1"
    assert hash_tag("jp:{}:{x}") == "jp:{}:{x}"  # an empty first tag: the whole key
    assert hash_tag("plain") == "plain"


async def test_stream_stats_count_entries_lag_and_pending_per_band(bus: Bus) -> None:
    await bus.publish([("default", envelope(9)) for _ in range(2)])
    await bus.publish([("default", envelope(5)) for _ in range(4)])
    await bus.publish([("nobody", envelope(5)) for _ in range(2)])  # no consumer group yet
    consumer = bus.consumer("w1", ["default"])
    got = await consumer.read(3, 100)  # both high-band entries, then one of band 1
    await consumer.ack(got[:1])
    stats = {
        (s.queue, s.band): (s.length, s.lag, s.pending)
        for s in await bus.stream_stats(["default", "nobody", "unused", "default"])
    }
    assert stats == {
        ("default", 0): (1, 0, 1),
        ("default", 1): (4, 3, 1),
        ("default", 2): (0, 0, 0),
        ("nobody", 0): (0, 0, 0),
        ("nobody", 1): (2, 2, 0),
        ("nobody", 2): (0, 0, 0),
        ("unused", 0): (0, 0, 0),
        ("unused", 1): (0, 0, 0),
        ("unused", 2): (0, 0, 0),
    }
    assert await bus.stream_stats([]) == []


async def test_read_never_returns_more_than_asked(bus: Bus) -> None:
    await bus.publish([("default", envelope(p)) for p in (9, 5, 1) for _ in range(4)])
    consumer = bus.consumer("w1", ["default"])
    first = await consumer.read(5, 100)
    assert len(first) == 5
    rest = await consumer.read(100, 100)
    assert len(rest) == 7


async def test_a_blocking_read_woken_by_several_streams_returns_no_more_than_asked(
    redis_bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The race: the read's first pass finds every stream empty, then entries land in three
    # of them before it blocks. Redis answers the blocking read with one entry per stream.
    consumer = redis_bus.consumer("w1", ["default"])
    sent = [envelope(8), envelope(4), envelope(1)]
    first_pass = consumer._read_each  # type: ignore[attr-defined]

    async def empty_then_filled(count: int) -> list[object]:
        await redis_bus.publish([("default", e) for e in sent])
        return []

    monkeypatch.setattr(consumer, "_read_each", empty_then_filled)
    got = await consumer.read(1, 1000)
    assert [d.envelope for d in got] == [sent[0]]
    monkeypatch.setattr(consumer, "_read_each", first_pass)
    # The other two are not lost: back in their streams, unread, for the next read.
    rest = await consumer.read(10, 100)
    assert sorted(d.envelope.priority for d in rest) == [1, 4]
    assert await consumer.read(10, 100) == []


async def test_higher_bands_are_read_first_under_a_backlog(bus: Bus) -> None:
    low, mid, high = envelope(1), envelope(4), envelope(8)
    await bus.publish([("default", low), ("default", mid), ("default", high)])
    got = await bus.consumer("w1", ["default"]).read(3, 100)
    assert [d.envelope for d in got] == [high, mid, low]
    assert band_of(8) == 0 and band_of(4) == 1 and band_of(1) == 2


async def test_pinned_entries_reach_only_their_worker(bus: Bus) -> None:
    pinned = envelope(pinned="w2")
    await bus.publish([("default", pinned)])
    assert await bus.consumer("w1", ["default"]).read(10, 50) == []
    got = await bus.consumer("w2", ["default"]).read(10, 50)
    assert [d.envelope for d in got] == [pinned]


async def test_drop_pinned_deletes_only_the_given_instances_entries(bus: Bus) -> None:
    given_away, other, kept = (envelope(pinned="gone") for _ in range(3))
    await bus.publish([("default", e) for e in (given_away, other, kept)])
    gone = bus.consumer("gone", ["default"])
    [delivered] = await gone.read(1, 50)  # delivered, never acknowledged: pending
    assert delivered.envelope == given_away
    assert await bus.drop_pinned("gone", [given_away.instance_id, uuid.uuid4()]) == 1
    assert await bus.drop_pinned("never-registered", [kept.instance_id]) == 0
    assert await gone.reclaim(0, 10) == []  # not left pending either
    assert [d.envelope for d in await gone.read(10, 50)] == [other, kept]


async def test_empty_read_returns_after_the_block(bus: Bus) -> None:
    consumer = bus.consumer("w1", ["default"])
    assert await asyncio.wait_for(consumer.read(10, 100), timeout=5) == []


async def test_blocking_read_wakes_on_publish(bus: Bus) -> None:
    consumer = bus.consumer("w1", ["default"])
    reading = asyncio.create_task(consumer.read(10, 5000))
    await asyncio.sleep(0.1)
    sent = envelope()
    await bus.publish([("default", sent)])
    got = await asyncio.wait_for(reading, timeout=5)
    assert [d.envelope for d in got] == [sent]


async def test_each_entry_goes_to_one_consumer_of_the_group(bus: Bus) -> None:
    sent = [envelope() for _ in range(20)]
    await bus.publish([("default", e) for e in sent])
    a, b = bus.consumer("a", ["default"]), bus.consumer("b", ["default"])
    got_a = await a.read(7, 50)
    got_b = await b.read(100, 50)
    ids = [d.envelope.instance_id for d in got_a + got_b]
    assert sorted(ids) == sorted(e.instance_id for e in sent)
    assert len(got_a) == 7


async def test_entries_of_a_dead_consumer_are_reclaimed_by_another(bus: Bus) -> None:
    sent = envelope()
    await bus.publish([("default", sent)])
    dying = bus.consumer("dying", ["default"])
    assert len(await dying.read(1, 50)) == 1
    del dying  # never acks
    other = bus.consumer("other", ["default"])
    assert await other.reclaim(60_000, 10) == []  # not idle long enough yet
    await asyncio.sleep(0.05)
    got = await other.reclaim(10, 10)
    assert [d.envelope for d in got] == [sent] and got[0].times_delivered >= 2
    await other.ack(got)
    assert await bus.consumer("third", ["default"]).reclaim(0, 10) == []


async def test_same_worker_id_finds_its_pending_entries_after_a_restart(bus: Bus) -> None:
    sent = envelope()
    await bus.publish([("default", sent)])
    assert len(await bus.consumer("w1", ["default"]).read(1, 50)) == 1
    restarted = bus.consumer("w1", ["default"])
    assert await restarted.read(1, 50) == []  # new reads skip it...
    got = await restarted.reclaim(0, 10)  # ...but it is still pending, under the same name
    assert [d.envelope for d in got] == [sent]


async def test_undecodable_entry_goes_to_dead_letters_and_reading_goes_on(
    bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    keys = keys_of(bus)
    stream = keys.queue_stream("default", band_of(5))
    consumer = bus.consumer("w1", ["default"])
    await consumer.read(1, 10)  # creates the groups
    good_before, good_after = envelope(), envelope()
    await bus.publish([("default", good_before)])
    await inject_raw(bus, stream, b"{not json")
    await bus.publish([("default", good_after)])
    with caplog.at_level(logging.WARNING, logger="jobplane.bus"):
        got = await consumer.read(10, 100)
    assert [d.envelope for d in got] == [good_before, good_after]
    [dead] = await bus.dead_letters("default")
    assert dead.raw == b"{not json" and dead.stream == stream and "undecodable" in dead.error
    lines = [r for r in caplog.records if getattr(r, "action", None) == "bus.dead_letter"]
    assert len(lines) == 1
    await consumer.ack(got)
    assert await consumer.reclaim(0, 10) == []  # the bad entry is not left pending


async def test_requeue_and_forward(bus: Bus) -> None:
    sent = envelope(job="unknown-here")
    await bus.publish([("default", sent)])
    first = bus.consumer("w1", ["default"])
    [delivery] = await first.read(1, 50)
    await first.requeue([delivery])
    [again] = await first.read(1, 50)
    assert again.envelope == sent and again.entry_id != delivery.entry_id
    await first.forward([again], "w2")
    assert await first.read(1, 50) == []
    [forwarded] = await bus.consumer("w2", ["default"]).read(1, 50)
    assert forwarded.envelope == sent
    assert await first.reclaim(0, 10) == []


async def test_pending_updates_compare_and_delete(bus: Bus) -> None:
    await bus.set_pending_updates({"a": 2, "b": 5})
    assert await bus.get_pending_updates(["a", "c"]) == {"a": 2}
    assert await bus.get_pending_updates() == {"a": 2, "b": 5}
    await bus.set_pending_updates({"a": 3})  # a newer edit
    assert not await bus.clear_pending_update("a", 2)  # clearing the old one keeps the new
    assert await bus.get_pending_updates(["a"]) == {"a": 3}
    assert await bus.clear_pending_update("a", 3)
    assert await bus.get_pending_updates(["a"]) == {}


async def test_a_reader_sees_every_mark_another_process_writes(
    redis_url: str, redis_prefix: str
) -> None:
    """A reader keeps the marks it read and reads them again only when the hash changed: a
    new mark, a newer version of a marked job, a mark cleared, and marks written without
    the edit count (by a version that did not keep one) all reach it."""
    writer, reader = open_bus(redis_url, redis_prefix), open_bus(redis_url, redis_prefix)
    assert isinstance(reader, RedisBus)
    try:
        assert await reader.get_pending_updates(["a", "b"]) == {}
        await writer.set_pending_updates({"a": 2})
        assert await reader.get_pending_updates(["a", "b"]) == {"a": 2}
        await writer.set_pending_updates({"a": 3, "b": 1})
        assert await reader.get_pending_updates(["a", "b"]) == {"a": 3, "b": 1}
        assert await writer.clear_pending_update("b", 1)
        assert await reader.get_pending_updates(["a", "b"]) == {"a": 3}
        await reader.client.hset(keys_of(reader).pending_updates(), "c", "7")  # no count
        assert await reader.get_pending_updates(["a", "c"]) == {"a": 3, "c": 7}
        assert await reader.get_pending_updates() == {"a": 3, "c": 7}  # the count is no mark
        await reader.client.delete(keys_of(reader).pending_updates())  # flushed
        assert await reader.get_pending_updates(["a", "c"]) == {}
    finally:
        await writer.close()
        await reader.close()


async def test_events_reach_every_subscriber(bus: Bus) -> None:
    async def first_event() -> Event:
        async for event in bus.subscribe():
            return event
        raise AssertionError("subscription ended")

    one = asyncio.create_task(first_event())
    two = asyncio.create_task(first_event())
    sent = Event(EventKind.DEFINITIONS_CHANGED, {"keys": ["a"]})
    for _ in range(50):  # subscriptions start asynchronously: publish until both hear it
        await bus.publish_event(sent)
        await asyncio.sleep(0.05)
        if one.done() and two.done():
            break
    assert await asyncio.wait_for(one, 5) == sent
    assert await asyncio.wait_for(two, 5) == sent


async def test_epoch_is_stable(bus: Bus) -> None:
    assert await bus.epoch() == await bus.epoch()
    assert (await bus.epoch()).marker is None  # nothing marked yet
    marked = await bus.mark_epoch()
    assert marked.marker is not None
    assert await bus.mark_epoch() == marked == await bus.epoch()  # set once, then stable


async def test_the_first_pass_keeps_priority_and_count_across_a_worker_and_two_queues(
    bus: Bus,
) -> None:
    # The worker's own stream, then each queue's bands, highest first; never over the count,
    # and what one call leaves is what the next one reads.
    pinned = envelope(1, pinned="w1")
    a_high, a_low, b_high, b_mid = envelope(9), envelope(0), envelope(7), envelope(5)
    await bus.publish([("a", a_low), ("b", b_mid), ("a", a_high), ("b", b_high), ("a", pinned)])
    consumer = bus.consumer("w1", ["a", "b"])
    assert [d.envelope for d in await consumer.read(3, 10)] == [pinned, a_high, a_low]
    assert [d.envelope for d in await consumer.read(5, 10)] == [b_high, b_mid]
