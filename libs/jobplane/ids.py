"""Time-ordered identifiers (UUIDv7), so instance tables can be partitioned by time later."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from uuid import UUID

from uuid_utils.compat import uuid7

#: How far the clock of a process that makes ids may be from the database's: a window on
#: ``created_at`` (the database's clock) also bounds the time-ordered id, widened by this much.
ID_CLOCK_SKEW = timedelta(minutes=5)


def new_id() -> UUID:
    """A new UUIDv7: its first 48 bits are the Unix time in milliseconds. Ids one process makes
    within a millisecond follow a counter in the bits after it, so they sort in the order made
    and keep that millisecond: an id made in a burst (a bulk trigger, a tick of many jobs)
    must not run ahead of the clock, or a creation window would miss it (see
    :data:`ID_CLOCK_SKEW`)."""
    return uuid7()


def id_floor(moment: datetime) -> UUID:
    """The smallest UUIDv7 of ``moment``'s millisecond: every id made at or after it is ≥."""
    ms = max(0, int(moment.timestamp() * 1000))
    return UUID(int=ms << 80)


def valid_ids(texts: Iterable[str]) -> list[UUID]:
    """The UUIDs of ``texts`` that are one (a notification's payload, read as it came)."""
    found = []
    for text in texts:
        try:
            found.append(UUID(text))
        except ValueError:
            continue
    return found
