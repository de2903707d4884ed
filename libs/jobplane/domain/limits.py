"""What every entrance checks, so that nothing is stored that cannot be read back.

The API, the HTTP client and :func:`~jobplane.enqueue.enqueue` all call these before a value
reaches the store: arguments nested too deep or too large, text the database cannot hold (NUL,
lone surrogates), numbers JSON cannot carry (NaN, infinities, integers too long to write out),
idempotency keys in the namespace Jobplane keeps for itself, and datetimes outside what the
store can represent. Each raises :class:`~jobplane.errors.InvalidOptionsError` naming the field
at fault.
"""

from __future__ import annotations

import json
import math
import re
import sys
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from jobplane.errors import InvalidOptionsError

#: Arguments (and results) nested deeper than this are refused. Every read path serialises
#: an instance inside a page inside a response, each adding levels; the serialisers stop at a
#: few hundred, so the margin is wide.
MAX_JSON_DEPTH = 64
#: Encoded size (UTF-8 JSON) above which arguments are refused.
MAX_ARGS_BYTES = 1_048_576
#: Encoded size above which a job's result is refused (the attempt fails, saying why).
MAX_RESULT_BYTES = 16 * 1_048_576
#: Postgres ``integer`` columns (max_concurrency, priority, attempt counters).
INT32_MAX = 2**31 - 1
#: Idempotency keys starting with these are Jobplane's own (a bulk retry uses
#: ``retry-of:<instance id>``); a client may not take them.
BULK_RETRY_KEY_PREFIX = "retry-of:"
RESERVED_KEY_PREFIXES = (BULK_RETRY_KEY_PREFIX,)
IDEMPOTENCY_KEY_MAX = 200
#: Integers with more digits are refused: Python's ``json`` (and ``int()``) refuse to convert
#: longer ones by default, in the store's encoder as in every reader, so such a value could be
#: neither stored nor read back.
MAX_INT_DIGITS = sys.int_info.default_max_str_digits
#: Integers below this in magnitude (fewer than 640 digits) are under any limit Python can be
#: set to: only larger ones are looked at more closely, so the common case costs a comparison.
_INT_SMALL = 10**sys.int_info.str_digits_check_threshold
#: The encoding whose size is checked (one encoder, not one built per call as ``json.dumps``
#: with options does: most of the check's time for a small value).
_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def check_json(
    value: Any,
    field: str = "args",
    *,
    max_depth: int = MAX_JSON_DEPTH,
    max_bytes: int = MAX_ARGS_BYTES,
) -> None:
    """Raise InvalidOptionsError unless ``value`` is plain JSON the store can keep and give
    back: objects with string keys, arrays, finite numbers, integers of at most
    :data:`MAX_INT_DIGITS` digits, text without NUL or lone surrogates, at most ``max_depth``
    levels deep and ``max_bytes`` long encoded. The field named is the JSON path of the first
    fault (``args.items.3``). Every value accepted encodes with ``json.dumps``, a bare number
    included."""
    # Iterative, so that a value nested thousands deep cannot exhaust the stack here.
    stack: list[tuple[Any, str, int]] = [(value, field, 1)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, dict | list):
            _push_children(node, path, depth, stack, field, max_depth)
        elif isinstance(node, str):
            check_text(node, path)
        elif isinstance(node, float):
            if not math.isfinite(node):
                raise InvalidOptionsError(path, "numbers must be finite (no NaN or Infinity)")
        elif isinstance(node, int):  # booleans too: they are ints, and never large
            if not -_INT_SMALL < node < _INT_SMALL:
                check_int_digits(node, path)
        elif node is not None:
            raise InvalidOptionsError(path, f"not a JSON value ({type(node).__name__})")
    if not isinstance(value, dict | list | str):
        return  # a number, a boolean or null: a few bytes
    try:
        size = len(_COMPACT.encode(value).encode())
    except (ValueError, TypeError, RecursionError) as exc:
        # The walk above accepts only what encodes; this is the backstop for what it cannot
        # see (a container subclass that iterates differently): the value is refused here,
        # with the field named, rather than by the store's encoder, where nothing expects it.
        raise InvalidOptionsError(field, f"cannot be encoded as JSON ({exc})") from None
    if size > max_bytes:
        raise InvalidOptionsError(field, f"{size} bytes encoded; the limit is {max_bytes}")


def _push_children(
    node: dict[Any, Any] | list[Any],
    path: str,
    depth: int,
    stack: list[tuple[Any, str, int]],
    field: str,
    max_depth: int,
) -> None:
    """Push a container's children for :func:`check_json` to check, once its keys are."""
    if depth > max_depth:
        # The top field is named: the path down there is as long as the nesting.
        raise InvalidOptionsError(field, f"nested deeper than {max_depth} levels")
    if isinstance(node, list):
        stack.extend((child, f"{path}.{index}", depth + 1) for index, child in enumerate(node))
        return
    if not all(type(key) is str for key in node):
        _check_key_collisions(node, path)
    for key, child in node.items():
        if isinstance(key, str):
            name: str | int = key[:40]
            check_text(key, f"{path}.{name}")
        elif isinstance(key, int):  # JSON writes it out as text, as it does a value
            # Checked before the key is written into a path: a huge one cannot be.
            if not -_INT_SMALL < key < _INT_SMALL:
                check_int_digits(key, path)
            name = key
        else:
            raise InvalidOptionsError(path, "object keys must be text")
        stack.append((child, f"{path}.{name}", depth + 1))


def _check_key_collisions(node: dict[Any, Any], path: str) -> None:
    """Refuse an object two of whose keys JSON writes alike (``1`` and ``"1"``, ``True`` and
    ``"true"``): stored, the second silently replaced the first."""
    # (Two number keys never read alike: a dict holds 1 or True, not both.)
    for key in node:
        if isinstance(key, bool):
            text = "true" if key else "false"
        elif isinstance(key, int) and -_INT_SMALL < key < _INT_SMALL:
            text = str(key)
        else:
            continue  # (text as it is; a huge number is refused by the walk)
        if text in node:
            raise InvalidOptionsError(
                f"{path}.{text}", "this key is given twice (as a number and as text)"
            )


_NUMBER_TEXT = re.compile(r"\s*[-+]?[0-9]+(\.[0-9]*)?\s*")


def is_a_number(value: object) -> bool:
    """Whether ``value`` is a number, or text that is one: not a time. (Parsing a time, the
    validation library reads a number as Unix seconds, or as milliseconds once above 2e10:
    253402300799, meant as 9999 in seconds, became a day of 1978.)"""
    if isinstance(value, str):
        return _NUMBER_TEXT.fullmatch(value) is not None
    return isinstance(value, int | float)


def check_int_digits(value: int, field: str) -> None:
    """Refuse an integer with more than :data:`MAX_INT_DIGITS` digits, or more than this
    process may convert to text (``sys.set_int_max_str_digits`` can lower the limit)."""
    limit = sys.get_int_max_str_digits()
    digits = MAX_INT_DIGITS if limit == 0 else min(limit, MAX_INT_DIGITS)
    bound = 10**digits
    if not -bound < value < bound:
        raise InvalidOptionsError(field, f"integers may have at most {digits} digits")


def check_text(value: str, field: str, *, max_length: int | None = None) -> str:
    """``value`` if the database can store it: no NUL, no lone surrogate, not too long."""
    if max_length is not None and len(value) > max_length:
        raise InvalidOptionsError(field, f"at most {max_length} characters")
    if "\x00" in value:
        raise InvalidOptionsError(field, "NUL characters are not allowed")
    try:
        value.encode()
    except UnicodeEncodeError:
        raise InvalidOptionsError(field, "must be valid Unicode (no lone surrogates)") from None
    return value


def check_idempotency_key(key: str, field: str = "idempotency_key") -> str:
    """A client's idempotency key: 1-200 characters of storable text, not in a namespace
    Jobplane reserves for its own keys."""
    if not key.strip():
        raise InvalidOptionsError(field, "must not be empty")
    check_text(key, field, max_length=IDEMPOTENCY_KEY_MAX)
    for prefix in RESERVED_KEY_PREFIXES:
        if key.startswith(prefix):
            raise InvalidOptionsError(field, f"keys starting with {prefix!r} are reserved")
    return key


def check_int32(value: int, field: str) -> int:
    if not -INT32_MAX - 1 <= value <= INT32_MAX:
        raise InvalidOptionsError(field, f"must be at most {INT32_MAX}")
    return value


def to_utc(value: datetime, field: str, *, naive_is_utc: bool = True) -> datetime:
    """``value`` in UTC. A naive value is taken as UTC (or refused when not
    ``naive_is_utc``); one whose UTC time falls outside years 1-9999 is refused (an offset can
    push ``0001-01-01T00:00+01:00`` before year 1)."""
    if value.tzinfo is None or value.utcoffset() is None:
        if not naive_is_utc:
            raise InvalidOptionsError(field, "must carry a UTC offset (e.g. 2026-01-01T00:00Z)")
        return value.replace(tzinfo=UTC)
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise InvalidOptionsError(field, "out of range (years 1 to 9999 in UTC)") from None


def bulk_retry_key(instance_id: UUID) -> str:
    """The idempotency key of a bulk retry's new instance for ``instance_id``: a replayed bulk
    retry creates nothing, and a bulk retry selects only instances without one."""
    return f"{BULK_RETRY_KEY_PREFIX}{instance_id}"
