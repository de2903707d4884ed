"""What the roles' readiness probes share: is a backend reachable, within a bounded time."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from jobplane.errors import UnavailableError

#: A readiness check of Postgres or Redis fails when it takes longer than this.
CHECK_TIMEOUT_S = 1.0


async def reach(ping: Callable[[], Awaitable[None]]) -> dict[str, Any]:
    """``{"ok": …, "detail": …}`` for one backend's ``ping``: unreachable, or no answer within
    :data:`CHECK_TIMEOUT_S` (a probe must answer before its orchestrator gives up on it)."""
    try:
        await asyncio.wait_for(ping(), CHECK_TIMEOUT_S)
    except TimeoutError:
        return {"ok": False, "detail": f"no answer within {CHECK_TIMEOUT_S:g} s"}
    except UnavailableError as exc:
        return {"ok": False, "detail": str(exc)}
    return {"ok": True, "detail": "reachable"}
