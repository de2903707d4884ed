"""The Overview page: instances by state, throughput, the leader, workers, recent failures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from jobplane.domain.models import Bucket, InstanceFilter, Lags
from jobplane.domain.states import InstanceState
from jobplane_api.dashboard.cluster import app_jobs, cluster_view
from jobplane_api.dashboard.reads import PageReads
from jobplane_api.dashboard.render import render
from jobplane_api.dashboard.session import ViewerDep
from jobplane_api.dashboard.shared import Shared
from jobplane_api.deps import StoreDep

router = APIRouter(include_in_schema=False)

FAILURES_SHOWN = 8
FAILED = (InstanceState.FAILED, InstanceState.TERMINATED)


@dataclass(frozen=True, slots=True)
class Chart:
    """Attempts that ended per bucket, drawn in the browser by uPlot (static/vendor/uplot):
    succeeded, and failed stacked above. An instance terminated after a failed attempt would
    count twice, so terminations are only counted in the legend."""

    title: str
    per: str  # "min" or "h"
    buckets: list[Bucket]

    @property
    def succeeded(self) -> int:
        return sum(b.succeeded for b in self.buckets)

    @property
    def failed(self) -> int:
        return sum(b.failed for b in self.buckets)

    @property
    def terminated(self) -> int:
        return sum(b.terminated for b in self.buckets)

    @property
    def peak(self) -> int:
        return max((b.succeeded + b.failed for b in self.buckets), default=0)

    def data(self) -> dict[str, Any]:
        return {
            "kind": "throughput",
            "per": self.per,
            "starts": [b.start.timestamp() for b in self.buckets],
            "series": [
                {
                    "label": "Succeeded",
                    "color": "ok",
                    "values": [b.succeeded for b in self.buckets],
                },
                {"label": "Failed", "color": "bad", "values": [b.failed for b in self.buckets]},
            ],
        }


@router.get("/apps/{app}/", response_class=HTMLResponse)
@router.get("/", response_class=HTMLResponse)
async def overview(
    request: Request, session: ViewerDep, store: StoreDep, partial: bool = False, app: str = ""
) -> HTMLResponse:
    """Every job's figures, or (``/apps/{app}/``) those of one app's jobs: its instances by
    state, its throughput and failures, and the workers that registered its jobs. The lags
    and the leader are the cluster's."""
    keys = await app_jobs(store, app)
    lags: Shared[Lags] = request.app.state.dashboard_lags
    failed = InstanceFilter(states=FAILED, job_keys=keys)
    async with PageReads(store) as reads:  # independent reads, started together
        last_hour = reads.read(store.throughput, 60, 60, job_keys=keys)
        last_day = reads.read(store.throughput, 3600, 24, job_keys=keys)
        failures = reads.read(store.list_instances, failed, limit=FAILURES_SHOWN)
        counts_read = reads.read(store.count_by_state, job_keys=keys)
        lags_read = reads.read(lags.get, store.lags)
        cluster = reads.compose(cluster_view, store, reads, keys)
    counts = counts_read.result()
    context: dict[str, Any] = {
        "nav": "overview",
        "app": app,
        "counts": {s: counts.get(s, 0) for s in InstanceState},
        "total": sum(counts.values()),
        "charts": [
            Chart("Last hour", "min", last_hour.result()),
            Chart("Last day", "h", last_day.result()),
        ],
        "failures": failures.result().items,
        "lags": lags_read.result(),
        **cluster.result(),
    }
    name = "_overview.html" if partial else "overview.html"
    return await render(request, session, name, context)
