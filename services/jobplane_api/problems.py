"""RFC 9457 problem+json for every error the API returns; bad input never becomes a 500."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jobplane.dispatch import JobDisabledError
from jobplane.errors import (
    IllegalTransitionError,
    InstanceNotFoundError,
    InvalidOptionsError,
    JobNotFoundError,
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
) -> JSONResponse:
    body: dict[str, Any] = {"type": "about:blank", "title": title, "status": status}
    if detail is not None:
        body["detail"] = detail
    if request is not None:
        body["instance"] = request.url.path
    if errors is not None:
        body["errors"] = errors
    return JSONResponse(body, status_code=status, media_type=PROBLEM_JSON)


def install(app: FastAPI) -> None:
    """Register the handlers that turn errors into problem+json."""

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {"field": ".".join(str(p) for p in e["loc"]), "reason": e["msg"]} for e in exc.errors()
        ]
        return problem(
            422,
            "Invalid request",
            errors[0]["reason"] if errors else None,
            request=request,
            errors=errors,
        )

    @app.exception_handler(InvalidOptionsError)
    async def _invalid(request: Request, exc: InvalidOptionsError) -> JSONResponse:
        return problem(
            422,
            "Invalid request",
            str(exc),
            request=request,
            errors=[{"field": exc.field, "reason": exc.reason}],
        )

    @app.exception_handler(JobNotFoundError)
    async def _no_job(request: Request, exc: JobNotFoundError) -> JSONResponse:
        return problem(404, "Job not found", str(exc), request=request)

    @app.exception_handler(InstanceNotFoundError)
    async def _no_instance(request: Request, exc: InstanceNotFoundError) -> JSONResponse:
        return problem(404, "Instance not found", str(exc), request=request)

    @app.exception_handler(IllegalTransitionError)
    async def _illegal(request: Request, exc: IllegalTransitionError) -> JSONResponse:
        return problem(409, "Illegal state transition", str(exc), request=request)

    @app.exception_handler(JobDisabledError)
    async def _disabled(request: Request, exc: JobDisabledError) -> JSONResponse:
        return problem(409, "Job disabled", str(exc), request=request)

    @app.exception_handler(UnavailableError)
    async def _unavailable(request: Request, exc: UnavailableError) -> JSONResponse:
        logger.warning("%s", exc, extra={"action": "api.unavailable"})
        return problem(503, "Service unavailable", str(exc), request=request)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = problem(
            exc.status_code, _title(exc.status_code), str(exc.detail), request=request
        )
        for name, value in (exc.headers or {}).items():
            response.headers[name] = value
        return response


def _title(status: int) -> str:
    from http import HTTPStatus

    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"
