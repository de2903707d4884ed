"""The README's example, whole: a shared resource with startup and shutdown hooks, a triggered
job with typed arguments, retries and progress, and a recurring sync job that checkpoints.

Run it on the embedded default (SQLite file + in-process bus)::

    jobplane dev --app examples.shop:app \
        --trigger 'send_receipt={"order_id": 7, "email": "a@b.c"}' --exit-when-done

Mail is "sent" by appending a JSON line to the outbox file (``SHOP_OUTBOX``, default
``shop-outbox.jsonl``), so the run leaves something to look at.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from jobplane import App, Backoff, JobContext

app = App("shop")


class Receipt(BaseModel):
    order_id: int
    email: str


class Mailer:
    """A shared resource: opened once per worker, injected into jobs, closed at shutdown."""

    def __init__(self, outbox: Path) -> None:
        self._file = outbox.open("a", encoding="utf-8")
        self._lock = asyncio.Lock()

    async def send(self, to: str, subject: str) -> None:
        async with self._lock:
            self._file.write(json.dumps({"to": to, "subject": subject}) + "\n")
            self._file.flush()

    def close(self) -> None:
        self._file.close()


@app.on_startup
async def open_mailer() -> dict[str, Any]:
    return {"mailer": Mailer(Path(os.environ.get("SHOP_OUTBOX", "shop-outbox.jsonl")))}


@app.on_shutdown
async def close_mailer(resources: Mapping[str, Any]) -> None:
    if "mailer" in resources:  # (not when opening it failed)
        resources["mailer"].close()


@app.triggered(
    retries=3, backoff=Backoff(delay_s=2, max_delay_s=60), max_concurrency=5, timeout_s=60
)
async def send_receipt(ctx: JobContext, args: Receipt, mailer: Mailer) -> dict[str, str]:
    ctx.logger.info("sending receipt for order %s", args.order_id)
    ctx.progress(0.5, "rendering")
    await mailer.send(args.email, f"Order {args.order_id}")
    return {"sent_to": args.email}


@app.recurring("0 3 * * *", timezone="Europe/Berlin", misfire="skip")
def nightly_cleanup(ctx: JobContext) -> int:
    """A sync job (it runs in the worker's thread pool): works in chunks, saves where it is,
    and stops early when asked; a retry resumes from the last checkpoint."""
    done: int = (ctx.last_checkpoint or {}).get("chunks", 0)
    while done < 10 and not ctx.cancelled:
        done += 1  # … delete one chunk of expired rows …
        ctx.checkpoint_sync({"chunks": done})
        ctx.progress(done / 10)
    return done
