"""The dashboard: server-rendered pages served by the api role at ``/`` (the REST API stays
under ``/api/v1``). Every asset ships in this package: no CDN, works offline."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from starlette.responses import Response

from jobplane.domain.models import Lags
from jobplane_api.dashboard import access, bulkfilter, instances, jobs, overview, workers
from jobplane_api.dashboard.render import HEADERS, HERE, templates
from jobplane_api.dashboard.session import Forbidden, LoginRequired
from jobplane_api.dashboard.shared import Shared

#: How long the Overview's hourly lag figures are shared by every viewer.
LAGS_TTL_S = 10.0

#: Requests from the pages' own polling script carry this header: a lost session answers 401
#: (the script shows "signed out") instead of a redirect to the login form.
LIVE_HEADER = "x-live"


def mount(app: FastAPI) -> None:
    """Add the dashboard's pages, static files and error pages to ``app``."""
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="dashboard-static")
    app.state.dashboard_lags = Shared[Lags](LAGS_TTL_S)
    for module in (access, overview, jobs, bulkfilter, instances, workers):
        app.include_router(module.router)
    app.add_exception_handler(LoginRequired, _login_required)  # type: ignore[arg-type]
    app.add_exception_handler(Forbidden, _forbidden)  # type: ignore[arg-type]


async def _login_required(request: Request, exc: LoginRequired) -> Response:
    if request.headers.get(LIVE_HEADER):
        return Response("signed out", status_code=401, media_type="text/plain")
    return RedirectResponse(f"/login?next={_quote(exc.next_url)}", status_code=303)


async def _forbidden(request: Request, exc: Forbidden) -> HTMLResponse:
    return templates.TemplateResponse(
        request,
        "error.html",
        {"session": None, "flash": None, "title": "Forbidden", "detail": exc.reason},
        status_code=403,
        headers=HEADERS,
    )


def _quote(path: str) -> str:
    from urllib.parse import quote

    return quote(path, safe="/")
