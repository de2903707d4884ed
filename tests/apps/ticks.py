"""Recurring one-second jobs, one per misfire policy, for the scheduler failover test (run by
a real worker process). Each returns the tick it ran for. Their concurrency limit is above one so
that a catch-up of several ticks runs them all (the limit's own Skipped are tested elsewhere)."""

from __future__ import annotations

from jobplane import App, JobContext

app = App("ticks")


def _tick(ctx: JobContext) -> str | None:
    return ctx.scheduled_at.isoformat() if ctx.scheduled_at else None


@app.recurring("* * * * * *", max_concurrency=10, misfire="fire_once")
async def tick_once(ctx: JobContext) -> str | None:
    return _tick(ctx)


@app.recurring("* * * * * *", max_concurrency=10, misfire="fire_once")
async def tick_once_2(ctx: JobContext) -> str | None:
    return _tick(ctx)


@app.recurring("* * * * * *", max_concurrency=10, misfire="fire_all")
async def tick_all(ctx: JobContext) -> str | None:
    return _tick(ctx)


@app.recurring("* * * * * *", max_concurrency=10, misfire="skip")
async def tick_skip(ctx: JobContext) -> str | None:
    return _tick(ctx)
