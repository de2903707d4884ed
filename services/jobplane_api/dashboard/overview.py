"""The Overview page: instances by state, throughput, the leader, workers, recent failures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from jobplane.domain.models import Bucket, InstanceFilter, Lags
from jobplane.domain.states import InstanceState
from jobplane_api.dashboard.cluster import cluster_view
from jobplane_api.dashboard.render import render
from jobplane_api.dashboard.session import ViewerDep
from jobplane_api.dashboard.shared import Shared
from jobplane_api.deps import StoreDep

router = APIRouter(include_in_schema=False)

FAILURES_SHOWN = 8
FAILED = (InstanceState.FAILED, InstanceState.TERMINATED)
#: Drawing area of the throughput chart, in SVG user units.
CHART_W, CHART_H = 600, 90


@dataclass(frozen=True, slots=True)
class Bar:
    x: float
    width: float
    ok_h: float
    bad_h: float
    label: str


@dataclass(frozen=True, slots=True)
class Chart:
    title: str
    per: str  # "min" or "h"
    since: str  # the left edge, in words
    bars: list[Bar]
    peak: int
    succeeded: int
    failed: int
    terminated: int

    @classmethod
    def of(cls, title: str, per: str, since: str, buckets: list[Bucket]) -> Chart:
        drawn, peak = bars(buckets)
        return cls(
            title,
            per,
            since,
            drawn,
            peak,
            sum(b.succeeded for b in buckets),
            sum(b.failed for b in buckets),
            sum(b.terminated for b in buckets),
        )


def bars(buckets: list[Bucket]) -> tuple[list[Bar], int]:
    """Stacked attempts (succeeded below, failed above), scaled to the busiest minute. An
    instance terminated after a failed attempt would count twice, so terminations are only
    counted in the legend and the bar's label."""
    peak = max((b.succeeded + b.failed for b in buckets), default=0)
    scale = CHART_H / peak if peak else 0.0
    step = CHART_W / max(len(buckets), 1)
    out = []
    for n, b in enumerate(buckets):
        label = (
            f"{b.start:%H:%M} UTC: {b.succeeded} succeeded, {b.failed} failed, "
            f"{b.terminated} terminated"
        )
        ok_h, bad_h = b.succeeded * scale, b.failed * scale
        out.append(Bar(n * step + 1, max(step - 2, 1), ok_h, bad_h, label))
    return out, peak


@router.get("/", response_class=HTMLResponse)
async def overview(
    request: Request, session: ViewerDep, store: StoreDep, partial: bool = False
) -> HTMLResponse:
    shared: Shared[dict[InstanceState, int]] = request.app.state.dashboard_counts
    counts = await shared.get(store.count_by_state)
    lags: Shared[Lags] = request.app.state.dashboard_lags
    charts = [
        Chart.of("Last hour", "min", "60 min ago", await store.throughput(60, 60)),
        Chart.of("Last day", "h", "24 h ago", await store.throughput(3600, 24)),
    ]
    failures = await store.list_instances(InstanceFilter(states=FAILED), limit=FAILURES_SHOWN)
    context: dict[str, Any] = {
        "nav": "overview",
        "counts": {s: counts.get(s, 0) for s in InstanceState},
        "total": sum(counts.values()),
        "charts": charts,
        "chart_w": CHART_W,
        "chart_h": CHART_H,
        "failures": failures.items,
        "lags": await lags.get(store.lags),
        **await cluster_view(store),
    }
    name = "_overview.html" if partial else "overview.html"
    return await render(request, session, name, context)
