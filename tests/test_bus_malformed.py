"""Malformed bus entries, on the Redis Streams bus and the in-process bus: whatever a broken or
hostile producer appends (valid JSON with fields of the wrong type, JSON nested deeper than
the parser goes, bytes that are not text), the decode refuses it as an EnvelopeError, and a
consumer moves it to the dead letters with a log line, whether it reads it or reclaims it from
a consumer that died holding it. Raised instead, it would stop the worker, stay pending, and
stop every worker that reclaimed it after."""

from __future__ import annotations

import json
import logging
import time

import pytest

from jobplane.bus.abc import Bus
from jobplane.bus.envelope import Envelope
from jobplane.bus.keys import GROUP, band_of
from jobplane.bus.memory import MemoryBus, _Pending
from jobplane.bus.redis import RedisBus
from jobplane.errors import EnvelopeError
from tests.bus_helpers import envelope, inject_raw, keys_of

_ID = b'"00000000-0000-4000-8000-000000000001"'


def _body(**fields: bytes) -> bytes:
    """A version-1 envelope's JSON with ``fields`` replacing (or, as ``b""``, removing) its
    own."""
    body = {b"v": b"1", b"kind": b'"run"', b"id": _ID, b"job": b'"j"', b"prio": b"5"}
    body.update({name.encode(): value for name, value in fields.items()})
    return b"{" + b",".join(b'"%s":%s' % (k, v) for k, v in body.items() if v) + b"}"


#: One of each kind of malformed entry a reader has met or could meet.
MALFORMED: dict[str, bytes] = {
    "int_id": _body(id=b"5"),
    "list_id": _body(id=b'["x"]'),
    "object_id": _body(id=b'{"a":1}'),
    "null_id": _body(id=b"null"),
    "no_id": _body(id=b""),
    "bad_uuid": _body(id=b'"not-a-uuid"'),
    "deep": b"[" * 100_000,
    "deep_in_object": b'{"v":1,"kind":"run","id":' + b"[" * 100_000,
    "bool_prio": _body(prio=b"true"),
    "text_prio": _body(prio=b'"5"'),
    "float_prio": _body(prio=b"5.0"),
    "huge_prio": _body(prio=b"9" * 5000),  # more digits than the parser converts
    "bool_version": _body(v=b"true"),
    "float_version": _body(v=b"1.0"),
    "text_version": _body(v=b'"1"'),
    "int_kind": _body(kind=b"5"),
    "list_kind": _body(kind=b'["run"]'),
    "unknown_kind": _body(kind=b'"fly"'),
    "list_job": _body(job=b'["j"]'),
    "no_job": _body(job=b""),
    "int_pin": _body(pin=b"5"),
    "not_utf8": b"\xff\xfe{}",
    "a_string": b'"just text"',
    "a_number": b"5",
    "null": b"null",
    "empty": b"",
}


@pytest.mark.parametrize("raw", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_envelope_is_an_envelope_error_and_says_little(raw: bytes) -> None:
    with pytest.raises(EnvelopeError) as raised:
        Envelope.decode(raw)
    # It goes to a log line and a dead-letter entry: never the whole (maybe huge) body.
    assert len(str(raised.value)) <= 300


async def _groups(bus: Bus) -> str:
    """The band stream of priority 5, its consumer groups created."""
    await bus.consumer("w1", ["default"]).read(1, 10)
    return keys_of(bus).queue_stream("default", band_of(5))


def _dead_letter_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "action", None) == "bus.dead_letter"]


async def test_malformed_entries_are_dead_lettered_and_reading_goes_on(
    bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    stream = await _groups(bus)
    consumer = bus.consumer("w1", ["default"])
    good_before, good_after = envelope(), envelope()
    await bus.publish([("default", good_before)])
    for raw in MALFORMED.values():
        await inject_raw(bus, stream, raw)
    await bus.publish([("default", good_after)])
    with caplog.at_level(logging.WARNING, logger="jobplane.bus"):
        got = await consumer.read(100, 100)
    assert [d.envelope for d in got] == [good_before, good_after]
    dead = await bus.dead_letters("default", 100)
    assert [d.raw for d in dead] == list(MALFORMED.values())
    assert all(d.stream == stream and d.error for d in dead)
    assert len(_dead_letter_lines(caplog)) == len(MALFORMED)
    await consumer.ack(got)
    assert await consumer.reclaim(0, 100) == []  # none left pending


async def left_pending(bus: Bus, stream: str, raw: bytes) -> None:
    """``raw`` appended and delivered to a consumer that then died, without being decoded."""
    if isinstance(bus, RedisBus):
        await bus.client.xadd(stream, {"d": raw})
        await bus.client.xreadgroup(GROUP, "gone", {stream: ">"}, count=1)
        return
    assert isinstance(bus, MemoryBus)
    bus._append_raw(stream, raw)
    state = bus._stream(stream)
    entry_id = max(state.entries)
    state.last_delivered = entry_id
    state.pending[entry_id] = _Pending("gone", time.monotonic(), 1)


async def test_malformed_entries_a_dead_consumer_held_are_dead_lettered_on_reclaim(
    bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    stream = await _groups(bus)
    held = envelope()
    for raw in [*MALFORMED.values(), held.encode()]:
        await left_pending(bus, stream, raw)
    consumer = bus.consumer("w2", ["default"])
    with caplog.at_level(logging.WARNING, logger="jobplane.bus"):
        got = await consumer.reclaim(0, 100)
    assert [d.envelope for d in got] == [held]
    assert [d.raw for d in await bus.dead_letters("default", 100)] == list(MALFORMED.values())
    assert len(_dead_letter_lines(caplog)) == len(MALFORMED)
    await consumer.ack(got)
    assert await consumer.reclaim(0, 100) == []


async def test_any_error_a_decode_raises_dead_letters_the_entry(
    bus: Bus, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The consumer does not rely on the decode's catching every case: an error it missed
    (here, one made to slip through) dead-letters the entry too, with the traceback."""
    decode = Envelope.decode

    def gap(cls: type[Envelope], raw: bytes | str) -> Envelope:
        if raw == b"gap":
            raise AttributeError("a case the decode does not cover")
        return decode(raw)

    monkeypatch.setattr(Envelope, "decode", classmethod(gap))
    stream = await _groups(bus)
    good = envelope()
    await inject_raw(bus, stream, b"gap")
    await bus.publish([("default", good)])
    consumer = bus.consumer("w1", ["default"])
    with caplog.at_level(logging.WARNING, logger="jobplane.bus"):
        got = await consumer.read(10, 100)
    assert [d.envelope for d in got] == [good]
    [dead] = await bus.dead_letters("default")
    assert dead.raw == b"gap"
    assert dead.error == "undecodable envelope: AttributeError: a case the decode does not cover"
    [line] = _dead_letter_lines(caplog)
    assert line.exc_info is not None


async def test_an_entry_without_a_body_keeps_its_fields_in_its_dead_letter(
    redis_bus: Bus,
) -> None:
    """An entry some other writer appended to a stream, without the ``d`` field: its dead
    letter said only that (an empty body), nothing of what the entry was."""
    assert isinstance(redis_bus, RedisBus)
    stream = await _groups(redis_bus)
    await redis_bus.client.xadd(stream, {"job": "report", "x": b"\xff1"})
    assert await redis_bus.consumer("w1", ["default"]).read(10, 50) == []
    [dead] = await redis_bus.dead_letters("default", 10)
    assert "no 'd' field" in dead.error
    assert json.loads(dead.raw) == {"job": "report", "x": "\\xff1"}
