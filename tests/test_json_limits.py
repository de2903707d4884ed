"""``check_json`` accepts only what the store's encoder (``json.dumps``) can write and a reader
can parse back: integers too long to convert to text are refused where they are, with the field
named, bare or nested, as values or as keys."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from jobplane.bus.abc import Bus
from jobplane.dispatch import Dispatcher
from jobplane.domain.limits import MAX_INT_DIGITS, MAX_RESULT_BYTES, check_json
from jobplane.errors import InvalidOptionsError
from jobplane.store.sql import SqlStore
from tests.store_helpers import define

HUGE = 10**5000  # more digits than Python converts to text by default (4,300)


@pytest.mark.parametrize(
    ("value", "field", "at"),
    [
        (HUGE, "result", "result"),
        (-HUGE, "checkpoint", "checkpoint"),
        ([1, 2, HUGE], "result", "result.2"),
        ({"a": {"b": [HUGE]}}, "args", "args.a.b.0"),
        ({"n": 10**MAX_INT_DIGITS}, "args", "args.n"),  # one digit too many
        ({HUGE: 1}, "args", "args"),  # a key that long cannot be written into the path either
        ({"k": {-HUGE: 1}}, "checkpoint", "checkpoint.k"),
    ],
    # (Named: pytest would write the integers out for an id, and could not.)
    ids=["bare", "bare-negative", "in-a-list", "nested", "one-digit-too-many", "key", "inner-key"],
)
def test_an_integer_too_long_to_encode_is_refused_naming_the_field(
    value: Any, field: str, at: str
) -> None:
    with pytest.raises(InvalidOptionsError) as raised:
        check_json(value, field, max_bytes=MAX_RESULT_BYTES)
    assert raised.value.field == at
    assert f"at most {MAX_INT_DIGITS} digits" in raised.value.reason


@pytest.mark.parametrize(
    "value",
    [
        10**MAX_INT_DIGITS - 1,  # the longest accepted: 4,300 digits
        -(10**MAX_INT_DIGITS - 1),
        {"n": [10**MAX_INT_DIGITS - 1, True, None, 1.5, "text"]},
        {7: "an int key", "eight": 8},
        0,
        False,
        None,
        2.5,
    ],
    ids=["longest", "longest-negative", "nested", "int-key", "zero", "false", "null", "float"],
)
def test_every_value_accepted_encodes(value: Any) -> None:
    check_json(value, "result", max_bytes=MAX_RESULT_BYTES)
    json.loads(json.dumps(value))  # as the store writes it, and as a reader parses it


@pytest.fixture
def lowered_int_limit() -> Iterator[int]:
    """This process converts at most 1,000 digits (``sys.set_int_max_str_digits``)."""
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(1000)
    try:
        yield 1000
    finally:
        sys.set_int_max_str_digits(before)


def test_a_process_that_lowered_its_limit_refuses_what_it_could_not_encode(
    lowered_int_limit: int,
) -> None:
    # Within the default limit, but not this process's: its own encoder would raise.
    with pytest.raises(InvalidOptionsError) as raised:
        check_json({"n": 10**2000}, "args")
    assert raised.value.field == "args.n"
    assert f"at most {lowered_int_limit} digits" in raised.value.reason
    check_json({"n": 10**999}, "args")


async def test_a_trigger_with_an_integer_too_long_is_refused_before_anything_is_stored(
    pg_store: SqlStore, redis_bus: Bus
) -> None:
    await define(pg_store, "takes_anything")
    dispatcher = Dispatcher(pg_store, redis_bus)
    with pytest.raises(InvalidOptionsError) as raised:
        await dispatcher.trigger("takes_anything", {"value": HUGE})
    assert raised.value.field == "args.value"
    assert await pg_store.count_by_state("takes_anything") == {}


@pytest.mark.parametrize(
    ("value", "at"),
    [
        ({1: "a", "1": "b"}, "args.1"),
        ({"1": "a", 1: "b"}, "args.1"),
        ({True: 1, "true": 2}, "args.true"),
        ({"x": [{-7: 0, "-7": 1}]}, "args.x.0.-7"),
    ],
)
def test_two_keys_that_json_writes_alike_are_refused(value: Any, at: str) -> None:
    """Stored as JSON, the second replaced the first without a word: an argument lost."""
    with pytest.raises(InvalidOptionsError) as raised:
        check_json(value, "args")
    assert raised.value.field == at


async def test_a_keyed_trigger_whose_object_has_number_and_text_keys_is_fingerprinted(
    pg_store: SqlStore, redis_bus: Bus
) -> None:
    """Keys of both kinds could not be sorted for the request's fingerprint: TypeError. They
    are fingerprinted as stored (all text), so the same request replays."""
    await define(pg_store, "takes_anything")
    dispatcher = Dispatcher(pg_store, redis_bus)
    first = await dispatcher.trigger("takes_anything", {1: "a", "b": 2}, idempotency_key="k")
    again = await dispatcher.trigger("takes_anything", {"1": "a", "b": 2}, idempotency_key="k")
    assert again.id == first.id and first.args == {"1": "a", "b": 2}
