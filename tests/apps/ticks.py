"""Recurring one-second jobs, one per misfire policy, for the scheduler failover test (run by
a real worker process). Each returns the tick it ran for. Their concurrency limit is above one so
that a catch-up of several ticks runs them all (the limit's own Skipped are tested elsewhere)."""

from __future__ import annotations

from jobplane import App, JobContext

app = App("ticks")

#: Job key → misfire policy.
POLICIES = {
    "tick_once": "fire_once",
    "tick_once_2": "fire_once",
    "tick_all": "fire_all",
    "tick_skip": "skip",
}


async def tick(ctx: JobContext) -> str | None:
    return ctx.scheduled_at.isoformat() if ctx.scheduled_at else None


for key, policy in POLICIES.items():
    app.recurring("* * * * * *", key=key, max_concurrency=10, misfire=policy)(tick)
