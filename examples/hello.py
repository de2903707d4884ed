"""A first Jobplane app: one triggered job with typed arguments, one sync job, one recurring job.

Run it on the embedded default (SQLite file + in-process bus)::

    jobplane dev --app examples.hello:app --trigger 'greet={"name": "Ada"}' --exit-when-done
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, Field

from jobplane import App, JobContext

app = App("hello")


class Greeting(BaseModel):
    name: str = Field(min_length=1, description="Who to greet")
    excited: bool = False


class Greeter:
    """A shared resource, created once at worker start and injected into jobs by name."""

    def __init__(self, salutation: str) -> None:
        self.salutation = salutation

    def greet(self, name: str, excited: bool) -> str:
        return f"{self.salutation}, {name}{'!' if excited else '.'}"


@app.on_startup
async def create_resources() -> Mapping[str, Any]:
    return {"greeter": Greeter("Hello")}


@app.triggered(retries=2)
async def greet(ctx: JobContext, args: Greeting, greeter: Greeter) -> dict[str, str]:
    """Greet someone (an async job: it runs on the worker's event loop)."""
    ctx.logger.info("greeting %s", args.name)
    await asyncio.sleep(0.05)
    return {"message": greeter.greet(args.name, args.excited)}


@app.triggered(max_concurrency=2, timeout_s=30)
def crunch(ctx: JobContext) -> int:
    """Some blocking work (a sync job: it runs in the worker's thread pool)."""
    total = 0
    for i in range(200_000):
        if ctx.cancelled:
            break
        total += i * i
    time.sleep(0.05)
    return total


@app.recurring("* * * * * */10", timezone="UTC")
def heartbeat(ctx: JobContext) -> None:
    """Fires every 10 seconds (the sixth cron field is seconds)."""
    ctx.logger.info("still alive")
