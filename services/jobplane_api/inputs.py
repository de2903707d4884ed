"""Field types for what the API accepts: each runs a check of :mod:`jobplane.domain.limits`
while the request is validated, so a bad value is a 422 naming its field (``body.args``,
``query.created_after``, ``header.idempotency-key``) before anything reaches the store; and
:func:`decimal`, for the numbers read from raw text (form fields, headers)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, AwareDatetime, BeforeValidator, Field
from pydantic_core import PydanticCustomError

from jobplane.domain.limits import (
    IDEMPOTENCY_KEY_MAX,
    check_idempotency_key,
    check_json,
    check_text,
    is_a_number,
    to_utc,
)
from jobplane.errors import InvalidOptionsError

T = TypeVar("T")


def _as_validation(check: Callable[[T], Any], base: str) -> Callable[[T], T]:
    """``check`` as a pydantic validator: its InvalidOptionsError becomes a validation error
    at the field being validated; a deeper path it names (``args.a.b``) is kept in the
    message."""

    def validate(value: T) -> T:
        try:
            check(value)
        except InvalidOptionsError as exc:
            reason = exc.reason if exc.field == base else f"{exc.field}: {exc.reason}"
            raise PydanticCustomError("invalid_value", reason) from None
        return value

    return validate


def _utc(naive_is_utc: bool) -> Callable[[datetime], datetime]:
    def validate(value: datetime) -> datetime:
        try:
            return to_utc(value, "value", naive_is_utc=naive_is_utc)
        except InvalidOptionsError as exc:
            raise PydanticCustomError("invalid_datetime", exc.reason) from None

    return validate


def _not_a_number(value: Any) -> Any:
    """A time is ISO 8601 text, never a number (see ``is_a_number``)."""
    if is_a_number(value):
        raise PydanticCustomError(
            "datetime_type", "give the time as ISO 8601 text (2026-01-01T09:00:00Z), not a number"
        )
    return value


def _text(value: str) -> None:
    check_text(value, "text")


def decimal(text: str, max_digits: int) -> int | None:
    """``text`` as a number if it is 1 to ``max_digits`` ASCII digits, else None.

    For numbers read from text the client wrote (a form's version or row index, a header).
    ``str.isdigit`` is no guard before ``int``: it also accepts digits ``int`` refuses
    (superscripts such as "²"; a ValueError, so a 500), and any length, while ``int`` refuses
    more than 4,300 digits (and is quadratic in the length below that)."""
    if not 0 < len(text) <= max_digits or not text.isascii() or not text.isdigit():
        return None
    return int(text)


#: Trigger arguments: plain JSON, bounded in depth and size (see ``check_json``).
Args = Annotated[Any, AfterValidator(_as_validation(check_json, "args"))]
#: Storable text (no NUL, no lone surrogates) of at most 200 characters: names, keys, ids.
ShortText = Annotated[str, Field(max_length=200), AfterValidator(_as_validation(_text, "text"))]
#: A client's idempotency key: not empty, not in a reserved namespace.
IdempotencyKey = Annotated[
    str,
    Field(max_length=IDEMPOTENCY_KEY_MAX),
    AfterValidator(_as_validation(check_idempotency_key, "idempotency_key")),
]
#: A filter bound: with a UTC offset, or naive and then taken as UTC; ``2026-01-01`` is
#: midnight UTC. Normalised to UTC; values that fall outside years 1-9999 are refused.
FilterTime = Annotated[datetime, BeforeValidator(_not_a_number), AfterValidator(_utc(True))]
#: A time something should happen: a UTC offset is required (a naive time is ambiguous).
DueTime = Annotated[AwareDatetime, BeforeValidator(_not_a_number), AfterValidator(_utc(False))]
