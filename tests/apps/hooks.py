"""Apps whose startup hook misbehaves (tests/test_worker_process.py): one hangs, one raises."""

from __future__ import annotations

import asyncio
from typing import Any

from jobplane import App

hangs = App("hangs")
fails = App("fails")


@hangs.on_startup
async def connect_forever() -> dict[str, Any]:
    await asyncio.sleep(3600)  # a pool that never connects, say
    return {}


@fails.on_startup
async def connect_refused() -> dict[str, Any]:
    raise RuntimeError("the mail server refused the connection")


@hangs.triggered()
@fails.triggered()
async def nothing() -> None:
    return None
