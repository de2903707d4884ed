"""What the Redis bus and its consumers share: driver failures translated into
:class:`~jobplane.errors.BusUnavailableError`, replies' bytes read as text, and the hash tag
that decides which keys one call may touch."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from redis.exceptions import (
    ClusterDownError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from jobplane.errors import BusUnavailableError
from jobplane.tasks import being_cancelled

#: Replies of a server that cannot take a command for now, whatever the command holds: full
#: (``maxmemory`` under ``noeviction``, as docs/deploy.md asks), a replica (demoted by a
#: failover), a cluster without a master for the slot, unable to persist (``MISCONF``), busy in
#: a script. Waited out like a lost connection; raised as they came, they ended the role. (Not
#: ``BUSYGROUP`` and the like: replies about the data, which their callers handle.)
_NOT_NOW = (OutOfMemoryError, ReadOnlyError, ClusterDownError, TryAgainError)
#: The same replies as text (a script's ``redis.pcall`` hands them back unparsed).
_NOT_NOW_CODES = (
    "OOM ",
    "READONLY ",
    "CLUSTERDOWN ",
    "MASTERDOWN ",
    "TRYAGAIN ",
    "MISCONF ",
    "BUSY ",
)


@asynccontextmanager
async def translated(what: str) -> AsyncIterator[None]:
    """Connection failures and a server's "not now" replies become
    :class:`BusUnavailableError` (one line, no driver types)."""
    try:
        yield
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        if being_cancelled():
            raise asyncio.CancelledError from exc  # the cancel, as the driver reported it
        raise BusUnavailableError(f"Redis unavailable ({what}): {exc}") from exc
    except ResponseError as exc:
        if not isinstance(exc, _NOT_NOW) and not str(exc).startswith(_NOT_NOW_CODES):
            raise
        if being_cancelled():
            raise asyncio.CancelledError from exc
        reply = f"{type(exc).__name__}: {exc}"
        raise BusUnavailableError(f"Redis refuses commands for now ({what}): {reply}") from exc


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
