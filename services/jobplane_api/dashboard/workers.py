"""Workers and cluster: every worker (live first) and the scheduler leader's lease."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from jobplane_api.dashboard.cluster import app_jobs, cluster_view
from jobplane_api.dashboard.reads import PageReads
from jobplane_api.dashboard.render import render
from jobplane_api.dashboard.session import ViewerDep
from jobplane_api.deps import StoreDep

router = APIRouter(include_in_schema=False)


@router.get("/apps/{app}/workers", response_class=HTMLResponse)
@router.get("/workers", response_class=HTMLResponse)
async def workers_page(
    request: Request, session: ViewerDep, store: StoreDep, partial: bool = False, app: str = ""
) -> HTMLResponse:
    """Every worker, or (``/apps/{app}/workers``) those that registered one of the app's
    jobs; the scheduler replicas are the cluster's either way."""
    keys = await app_jobs(store, app)
    async with PageReads(store) as reads:
        cluster = reads.compose(cluster_view, store, reads, keys)
    context = {"nav": "workers", "app": app, **cluster.result()}
    name = "_workers.html" if partial else "workers.html"
    return await render(request, session, name, context)
