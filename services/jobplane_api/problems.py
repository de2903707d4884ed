"""RFC 9457 problem+json for every error the API returns; bad input never becomes a 500."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from jobplane.errors import (
    BusUnavailableError,
    DefinitionVersionNotFoundError,
    IdempotencyConflictError,
    IllegalTransitionError,
    InstanceNotFoundError,
    InvalidOptionsError,
    JobDisabledError,
    JobNotFoundError,
    LastAdminError,
    StoreRefusedError,
    UnavailableError,
)

logger = logging.getLogger(__name__)

PROBLEM_JSON = "application/problem+json"


def problem(
    status: int,
    title: str,
    detail: str | None = None,
    *,
    request: Request | None = None,
    errors: list[dict[str, Any]] | None = None,
) -> Response:
    if request is not None and _wants_a_page(request):
        return _page(request, status, title, detail)
    body: dict[str, Any] = {"type": "about:blank", "title": title, "status": status}
    if detail is not None:
        body["detail"] = detail
    if request is not None:
        body["instance"] = request.url.path
    if errors is not None:
        body["errors"] = errors
    return JSONResponse(body, status_code=status, media_type=PROBLEM_JSON)


def _wants_a_page(request: Request) -> bool:
    """A browser on the dashboard (a form sent for a job deleted meanwhile, say): answered
    with an HTML page it can show, not with problem+json. The API's paths, and any client
    that does not ask for HTML, get problem+json."""
    if request.url.path.startswith("/api/"):
        return False
    return "text/html" in request.headers.get("accept", "")


def _page(request: Request, status: int, title: str, detail: str | None) -> Response:
    from jobplane_api.dashboard.render import error_page

    return error_page(request, status, title, detail or title)


#: Domain errors that map to one status each.
STATUS_OF: list[tuple[type[Exception], int, str]] = [
    (JobNotFoundError, 404, "Job not found"),
    (DefinitionVersionNotFoundError, 404, "Version not found"),
    (InstanceNotFoundError, 404, "Instance not found"),
    (IllegalTransitionError, 409, "Illegal state transition"),
    (JobDisabledError, 409, "Job disabled"),
    (IdempotencyConflictError, 409, "Idempotency-Key reused with a different request"),
    (LastAdminError, 409, "Last admin token"),
]


def install(app: FastAPI) -> None:
    """Register the handlers that turn errors into problem+json."""
    for exc_type, status, title in STATUS_OF:
        app.add_exception_handler(exc_type, _fixed(status, title))
    app.add_exception_handler(RequestValidationError, _validation)  # type: ignore[arg-type]
    app.add_exception_handler(InvalidOptionsError, _invalid)  # type: ignore[arg-type]
    app.add_exception_handler(StoreRefusedError, _unstorable)  # type: ignore[arg-type]
    app.add_exception_handler(UnicodeEncodeError, _not_utf8)  # type: ignore[arg-type]
    app.add_exception_handler(UnavailableError, _unavailable)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http)  # type: ignore[arg-type]


def _fixed(status: int, title: str) -> Callable[[Request, Exception], Awaitable[Response]]:
    async def handle(request: Request, exc: Exception) -> Response:
        return problem(status, title, str(exc), request=request)

    return handle


async def _validation(request: Request, exc: RequestValidationError) -> Response:
    errors = [
        {"field": ".".join(str(p) for p in e["loc"]), "reason": _reason(e["msg"])}
        for e in exc.errors()
    ]
    first = errors[0]["reason"] if errors else None
    return problem(422, "Invalid request", first, request=request, errors=errors)


def _reason(message: str) -> str:
    # (pydantic prefixes what a validator raised: "Value error, must be a number, …")
    return message.removeprefix("Value error, ")


async def _invalid(request: Request, exc: InvalidOptionsError) -> Response:
    errors = [{"field": exc.field, "reason": exc.reason}]
    return problem(422, "Invalid request", str(exc), request=request, errors=errors)


async def _unstorable(request: Request, exc: StoreRefusedError) -> Response:
    # The database refused a value the schema let through (NUL in text, an escape jsonb
    # rejects, a date out of range: SQLSTATE class 22): bad input, not a server fault.
    # Anything else is a real fault and stays a 500.
    # The edge validates every field (jobplane_api.inputs), so this is a fallback: the
    # driver's wording (query arguments, types) goes to the log, not to the client.
    if not exc.sqlstate.startswith("22"):
        raise exc
    logger.warning("the database refused a value: %s", exc, extra={"action": "api.unstorable"})
    return problem(422, "Invalid request", "a value cannot be stored", request=request)


async def _not_utf8(request: Request, exc: UnicodeEncodeError) -> Response:
    # JSON may carry lone surrogates ("\ud800"), which no UTF-8 database can store.
    reason = "text must be valid Unicode (no lone surrogates)"
    return problem(422, "Invalid request", reason, request=request)


async def _unavailable(request: Request, exc: UnavailableError) -> Response:
    # The detail (host, port) goes to the log only.
    logger.warning("%s", exc, extra={"action": "api.unavailable"})
    what = "redis" if isinstance(exc, BusUnavailableError) else "database"
    return problem(503, "Service unavailable", f"{what}: unavailable", request=request)


async def _http(request: Request, exc: StarletteHTTPException) -> Response:
    response = problem(exc.status_code, _title(exc.status_code), str(exc.detail), request=request)
    for name, value in (exc.headers or {}).items():
        response.headers[name] = value
    return response


def _title(status: int) -> str:
    from http import HTTPStatus

    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"
