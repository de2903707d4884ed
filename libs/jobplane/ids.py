"""Time-ordered identifiers (UUIDv7), so instance tables can be partitioned by time later."""

from __future__ import annotations

from uuid import UUID

import uuid6


def new_id() -> UUID:
    """A new UUIDv7: its first 48 bits are the Unix time in milliseconds."""
    return UUID(int=uuid6.uuid7().int)
