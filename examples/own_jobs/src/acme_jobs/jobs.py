"""Acme's jobs: one triggered job with typed arguments, one recurring job.

Run by a worker of the Jobplane image as ``jobplane worker --app acme_jobs.jobs:app``.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from jobplane import App, JobContext

app = App("acme")


class Report(BaseModel):
    customer: str = Field(min_length=1, description="Whose report to build")
    months: int = Field(default=1, ge=1, le=24)


@app.triggered(queue="reports", retries=2, timeout_s=300)
async def build_report(ctx: JobContext, args: Report) -> dict[str, object]:
    """Build a (pretend) usage report for one customer."""
    ctx.logger.info("building a %d-month report for %s", args.months, args.customer)
    rows = [{"month": m + 1, "jobs": 100 * (m + 1)} for m in range(args.months)]
    return {"customer": args.customer, "rows": rows}


@app.recurring("0 6 * * 1", timezone="UTC", queue="reports")
def weekly_digest(ctx: JobContext) -> str:
    """Every Monday at 06:00 UTC."""
    return "digest sent"
