"""The dashboard: server-rendered pages served by the api role at ``/`` (the REST API stays
under ``/api/v1``). Every asset ships in this package: no CDN, works offline."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles
from starlette.responses import Response

from jobplane.domain.models import Lags
from jobplane_api.dashboard import access, bulkfilter, instances, jobs, overview, workers
from jobplane_api.dashboard.render import HERE, error_page
from jobplane_api.dashboard.session import (
    Forbidden,
    LoginRequired,
    Throttled,
    keep,
    session_of,
)
from jobplane_api.dashboard.shared import Shared

#: How long the Overview's hourly lag figures are shared by every viewer.
LAGS_TTL_S = 10.0

#: Requests from the pages' own polling script carry this header: a lost session answers 401
#: (the script shows "signed out") instead of a redirect to the login form, and a throttled
#: client a short 429 in plain text instead of a page.
LIVE_HEADER = "x-live"


def mount(app: FastAPI) -> None:
    """Add the dashboard's pages, static files and error pages to ``app``."""
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="dashboard-static")
    app.state.dashboard_lags = Shared[Lags](LAGS_TTL_S)
    for module in (access, overview, jobs, bulkfilter, instances, workers):
        app.include_router(module.router)
    app.add_exception_handler(LoginRequired, _login_required)  # type: ignore[arg-type]
    app.add_exception_handler(Forbidden, _forbidden)  # type: ignore[arg-type]
    app.add_exception_handler(Throttled, _throttled)  # type: ignore[arg-type]


async def _login_required(request: Request, exc: LoginRequired) -> Response:
    response: Response
    if request.headers.get(LIVE_HEADER):
        response = Response("signed out", status_code=401, media_type="text/plain")
    else:
        ended = ("&ended=form" if exc.sent else "&ended=page") if exc.ended else ""
        response = RedirectResponse(f"/login?next={_quote(exc.next_url)}{ended}", status_code=303)
    return _keep(response, request)


async def _forbidden(request: Request, exc: Forbidden) -> Response:
    return _keep(error_page(request, 403, "Forbidden", exc.reason), request)


async def _throttled(request: Request, exc: Throttled) -> Response:
    """429 with the API's Retry-After; the session cookie is left as it is (nothing was
    looked up, so nothing is known about it)."""
    retry = {"Retry-After": exc.retry_after}
    if request.headers.get(LIVE_HEADER):
        return Response(
            "too many failed sign-ins", status_code=429, media_type="text/plain", headers=retry
        )
    return error_page(request, 429, "Too many failed sign-ins", exc.reason, retry)


def _keep(response: Response, request: Request) -> Response:
    """Set the session's new cookie (an anonymous one in place of an unknown secret)."""
    session = session_of(request)
    return keep(response, request, session) if session is not None else response


def _quote(path: str) -> str:
    from urllib.parse import quote

    return quote(path, safe="/")
