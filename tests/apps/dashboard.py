"""Jobs the dashboard's browser tests drive through a real worker."""

from __future__ import annotations

import asyncio

from pydantic import BaseModel, Field

from jobplane import App, JobContext

app = App("dashboard-tests")


class Greeting(BaseModel):
    name: str = Field(min_length=1, description="Who to greet")
    excited: bool = False


@app.triggered(max_concurrency=10, description="Greets someone; returns the greeting.")
async def greet(ctx: JobContext, args: Greeting) -> dict[str, str]:
    ctx.progress(1.0, "greeted")
    return {"greeting": f"Hello, {args.name}{'!' if args.excited else '.'}"}


@app.triggered(max_concurrency=5, description="Works for a minute unless cancelled.")
async def crunch(ctx: JobContext) -> str:
    for step in range(600):
        ctx.progress(step / 600, f"step {step} of 600")
        await asyncio.sleep(0.1)
    return "done"


@app.triggered(description="Always fails.")
async def explode() -> None:
    raise ValueError("the <b>reactor</b> is not responding")


class Address(BaseModel):
    city: str = Field(min_length=1)
    postcode: str = ""


class Line(BaseModel):
    sku: str = Field(min_length=1)
    quantity: int = Field(ge=1, description="How many")
    # A list in a list's row; its description holds the row template's placeholder (the
    # lines' rows are "lines.__1__"), which a new row once put its index in.
    serials: list[str] = Field(default=[], description="As printed: SN-__1__-X")


class Order(BaseModel):
    customer: str
    address: Address
    lines: list[Line] = Field(min_length=1)
    tags: list[str] = []


@app.triggered(description="Ships an order: nested arguments.")
async def ship_order(args: Order) -> dict[str, int]:
    return {"lines": len(args.lines), "units": sum(line.quantity for line in args.lines)}


@app.recurring("0 3 1 * *", timezone="Europe/Berlin", queue="reports", name="Monthly report")
async def monthly_report() -> str:
    return "filed"
