"""Open the bus named by a URL: ``memory://`` (in-process) or ``redis://…``."""

from __future__ import annotations

import redis.asyncio as aioredis

from jobplane.bus.abc import Bus
from jobplane.bus.keys import Keys
from jobplane.bus.memory import MemoryBus
from jobplane.bus.redis import RedisBus
from jobplane.errors import ConfigurationError

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def open_bus(url: str, prefix: str = "jobplane", *, read_timeout_s: float | None = None) -> Bus:
    """A bus for ``url``; it owns the client it creates. Call ``ping()`` to fail fast.
    ``read_timeout_s``: how long a reply may take (redis-py's 5 s by default), longer than any
    blocking read the caller makes."""
    keys = Keys(prefix)
    if url.startswith("memory://"):
        return MemoryBus(keys)
    if url.startswith(REDIS_SCHEMES):
        timeouts = {} if read_timeout_s is None else {"socket_timeout": read_timeout_s}
        client = aioredis.from_url(
            url, socket_connect_timeout=5, health_check_interval=30, **timeouts
        )
        return RedisBus(client, keys, owns_client=True)
    from jobplane.store.factory import redact  # (the URL may hold a password)

    raise ConfigurationError(f"unsupported bus URL {redact(url)!r}: use redis://… or memory://")
