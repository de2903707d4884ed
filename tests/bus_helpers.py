"""Entries and keys for the bus tests, on either bus."""

from __future__ import annotations

import uuid

from jobplane.bus.abc import Bus
from jobplane.bus.envelope import Envelope
from jobplane.bus.keys import Keys
from jobplane.bus.memory import MemoryBus
from jobplane.bus.redis import RedisBus


def envelope(priority: int = 5, pinned: str | None = None, job: str = "job") -> Envelope:
    return Envelope(instance_id=uuid.uuid4(), job_key=job, priority=priority, pinned_worker=pinned)


def keys_of(bus: Bus) -> Keys:
    """The bus's key names (both buses have them; the ``Bus`` protocol does not say so)."""
    assert isinstance(bus, RedisBus | MemoryBus)
    return bus.keys


async def inject_raw(bus: Bus, stream: str, raw: bytes) -> None:
    """Add a malformed entry the way a broken producer would."""
    if isinstance(bus, RedisBus):
        await bus.client.xadd(stream, {"d": raw})
    else:
        assert isinstance(bus, MemoryBus)
        bus._append_raw(stream, raw)
