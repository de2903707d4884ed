"""Workers and cluster: every worker (live first) and the scheduler leader's lease."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from jobplane_api.dashboard.cluster import cluster_view
from jobplane_api.dashboard.render import render
from jobplane_api.dashboard.session import ViewerDep
from jobplane_api.deps import StoreDep

router = APIRouter(include_in_schema=False)


@router.get("/workers", response_class=HTMLResponse)
async def workers_page(
    request: Request, session: ViewerDep, store: StoreDep, partial: bool = False
) -> HTMLResponse:
    context = {"nav": "workers", **await cluster_view(store)}
    name = "_workers.html" if partial else "workers.html"
    return await render(request, session, name, context)
