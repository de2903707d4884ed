"""Open the bus named by a URL: ``memory://`` (in-process) or ``redis://…``."""

from __future__ import annotations

import redis.asyncio as aioredis

from jobplane.bus.abc import Bus
from jobplane.bus.keys import Keys
from jobplane.bus.memory import MemoryBus
from jobplane.bus.redis import RedisBus
from jobplane.errors import ConfigurationError

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def open_bus(url: str, prefix: str = "jobplane") -> Bus:
    """A bus for ``url``; it owns the client it creates. Call ``ping()`` to fail fast."""
    keys = Keys(prefix)
    if url.startswith("memory://"):
        return MemoryBus(keys)
    if url.startswith(REDIS_SCHEMES):
        client = aioredis.from_url(url, socket_connect_timeout=5, health_check_interval=30)
        return RedisBus(client, keys, owns_client=True)
    from jobplane.store.factory import redact  # (the URL may hold a password)

    raise ConfigurationError(f"unsupported bus URL {redact(url)!r}: use redis://… or memory://")
