"""A long job that notes when each attempt starts and stops (with the process that ran it), for
the partition test: two copies of one instance must never overlap."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from pydantic import BaseModel

from jobplane import App, JobContext

app = App("fencing")


class Notes(BaseModel):
    path: str


def _note(path: str, what: str, attempt: int) -> None:
    with Path(path).open("a", encoding="utf-8") as notes:
        notes.write(f"{time.time():.3f} {what} {attempt} {os.getpid()}\n")


@app.triggered(timeout_s=120, max_unexpected_retries=5)
async def holds(ctx: JobContext, args: Notes) -> str:
    _note(args.path, "start", ctx.attempt)
    try:
        for _ in range(60):
            await asyncio.sleep(0.25)
    finally:
        _note(args.path, "stop", ctx.attempt)
    return "done"


@app.triggered(timeout_s=120, max_unexpected_retries=5)
async def checkpoints(ctx: JobContext, args: Notes) -> str:
    """Like ``holds``, but the code waits on the store: it saves a checkpoint every 0.1 s, so
    the fence finds it awaiting a write on a connection the partition has cut."""
    _note(args.path, "start", ctx.attempt)
    try:
        for step in range(150):
            await ctx.checkpoint(step)
            await asyncio.sleep(0.1)
    finally:
        _note(args.path, "stop", ctx.attempt)
    return "done"


@app.triggered(timeout_s=120, max_unexpected_retries=5)
def checkpoints_sync(ctx: JobContext, args: Notes) -> str:
    """``checkpoints`` as sync code, in a pool thread: the fence cannot interrupt it, so it
    stops by itself when its checkpoint is not saved in time (CheckpointNotSavedError) or
    when it sees its cancellation between steps."""
    _note(args.path, "start", ctx.attempt)
    try:
        for step in range(150):
            if ctx.cancellation.is_set():
                return "stopped"
            ctx.checkpoint_sync(step)
            time.sleep(0.1)
    finally:
        _note(args.path, "stop", ctx.attempt)
    return "done"
