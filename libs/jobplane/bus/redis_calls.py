"""What the Redis bus and its consumers share: driver failures translated into
:class:`~jobplane.errors.BusUnavailableError`, replies' bytes read as text, and the hash tag
that decides which keys one call may touch."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from jobplane.errors import BusUnavailableError
from jobplane.tasks import being_cancelled


@asynccontextmanager
async def translated(what: str) -> AsyncIterator[None]:
    """Connection failures become :class:`BusUnavailableError` (one line, no driver types)."""
    try:
        yield
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        if being_cancelled():
            raise asyncio.CancelledError from exc  # the cancel, as the driver reported it
        raise BusUnavailableError(f"Redis unavailable ({what}): {exc}") from exc


def as_text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def hash_tag(key: str) -> str:
    """What Redis Cluster hashes of ``key``: its first non-empty ``{…}``, else the key."""
    start = key.find("{")
    if start >= 0:
        end = key.find("}", start + 1)
        if end > start + 1:
            return key[start + 1 : end]
    return key
