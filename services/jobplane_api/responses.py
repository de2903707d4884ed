"""What the OpenAPI document says about answers beyond their bodies: the problem+json errors
every route may give, and the links from one answer to the next operations."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

__all__ = ["INSTANCE_LINKS", "JOB_LIST_LINKS", "PROBLEM_RESPONSES", "Problem"]


class Problem(BaseModel):
    """RFC 9457 problem details."""

    type: str = "about:blank"
    title: str
    status: int
    detail: str | None = None
    instance: str | None = None
    errors: list[dict[str, Any]] | None = Field(
        default=None, description="Validation errors: JSON path of the field and the reason."
    )


_ERRORS = {
    400: "The body cannot be parsed (not JSON, not UTF-8, nested too deep)",
    401: "No token, or an unknown, revoked or expired one",
    403: "The token's role is too low",
    404: "No such job, instance or token",
    409: "Conflict: an illegal transition, a stale version, a disabled job, an "
    "Idempotency-Key reused with a different request",
    413: "Request body too large",
    422: "Invalid request: the fields at fault are in `errors`",
    429: "Too many failed authentications from this client (see `Retry-After`)",
    503: "Postgres or Redis unreachable",
}

#: The problem+json answers every API route may give (documented in OpenAPI).
PROBLEM_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": Problem, "description": text, "content": {"application/problem+json": {}}}
    for code, text in _ERRORS.items()
}


def _link(operation_id: str, **parameters: str) -> dict[str, Any]:
    return {"operationId": operation_id, "parameters": parameters}


#: OpenAPI links: what a client (or a stateful fuzzer) can do next with what an answer
#: holds. Operation ids are FastAPI's (function name, path and method).
INSTANCE_LINKS = {
    "201": {
        "description": "Created",
        "links": {
            "GetInstance": _link(
                "get_instance_api_v1_instances__instance_id__get", instance_id="$response.body#/id"
            ),
            "ListInstancesOfJob": _link(
                "list_instances_api_v1_instances_get", job="$response.body#/job_key"
            ),
            "CancelInstance": _link(
                "cancel_instance_api_v1_instances__instance_id__cancel_post",
                instance_id="$response.body#/id",
            ),
        },
    }
}
JOB_LIST_LINKS = {
    "200": {
        "description": "The jobs",
        "links": {
            "TriggerFirstJob": _link(
                "trigger_job_api_v1_jobs__key__instances_post", key="$response.body#/0/key"
            ),
            "GetFirstJob": _link("get_job_api_v1_jobs__key__get", key="$response.body#/0/key"),
        },
    }
}
