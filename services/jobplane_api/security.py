"""Bearer-token authentication and role checks for the API.

Every route but health, readiness and metrics declares the role it needs with
``Depends(require(Role.X))``; ``tests/test_api_authz_matrix.py`` walks the OpenAPI document so
that a new route cannot slip through unprotected. Requests under ``/api/`` are authenticated
before their body is read (``jobplane_api.authn``); ``require`` then only checks the role of
the principal found, or authenticates itself for a route outside ``/api/``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request, status
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from jobplane.auth import Role, TokenInfo
from jobplane_api.authn import CHALLENGE, PRINCIPAL, Authenticator, Refusal, client_of
from jobplane_api.deps import SettingsDep, StoreDep

Principal = TokenInfo | None  # None: auth is disabled (jobplane dev)

__all__ = [
    "CHALLENGE",
    "ROLE_EXTENSION",
    "Admin",
    "Operator",
    "Principal",
    "Viewer",
    "actor_of",
    "document_roles",
    "require",
]

#: Declares the bearer scheme in OpenAPI (the docs page's "Authorize" button); the check
#: itself is ours, so that every refusal is problem+json.
BEARER = HTTPBearer(
    auto_error=False,
    scheme_name="bearer",
    description="An API token: `Authorization: Bearer jp_…` (see `jobplane token create`).",
)


def require(role: Role) -> Callable[..., Awaitable[Principal]]:
    async def check(
        request: Request,
        store: StoreDep,
        settings: SettingsDep,
        _: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)],
    ) -> Principal:
        if not settings.auth_enabled:
            return None
        token: TokenInfo | None = request.scope.get("state", {}).get(PRINCIPAL)
        if token is None:
            authenticator: Authenticator = request.app.state.authenticator
            try:
                token = await authenticator.authenticate(
                    store, request.headers.get("authorization"), client_of(request.scope)
                )
            except Refusal as refusal:
                raise HTTPException(refusal.status, refusal.detail, refusal.headers) from None
        if not token.role.allows(role):
            raise HTTPException(
                status.HTTP_403_FORBIDDEN,
                f"this needs the {role.value} role; the token is {token.role.value}",
            )
        return token

    check.__name__ = f"require_{role.value}"
    return check


Viewer = Depends(require(Role.VIEWER))
Operator = Depends(require(Role.OPERATOR))
Admin = Depends(require(Role.ADMIN))


def actor_of(principal: Principal) -> str:
    return f"token:{principal.name}" if principal else "api"


ROLE_EXTENSION = "x-jobplane-role"


def document_roles(app: FastAPI, routers: Iterable[APIRouter]) -> None:
    """Have ``app``'s OpenAPI document say the role each operation of ``routers`` needs: an
    ``x-jobplane-role`` field and a sentence in its description, read from the route's own
    ``require`` dependency (so the document cannot disagree with the code). The
    authorization matrix test is generated from this."""
    routes = [route for router in routers for route in router.routes]
    default = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = default()
        for route in routes:
            if not isinstance(route, APIRoute) or not route.include_in_schema:
                continue
            role = _role_of(route)
            operations = document["paths"].get(route.path_format, {})
            for method in route.methods or ():
                operation = operations.get(method.lower())
                if operation is None or role is None:
                    continue
                operation[ROLE_EXTENSION] = role.value
                needs = f"Needs the **{role.value}** role (or higher)."
                operation["description"] = f"{operation.get('description', '')}\n\n{needs}".strip()
        app.openapi_schema = document
        return document

    app.openapi = openapi  # type: ignore[method-assign]


def _role_of(route: APIRoute) -> Role | None:
    pending = list(route.dependant.dependencies)
    while pending:
        dependant = pending.pop()
        name = getattr(dependant.call, "__name__", "")
        if name.startswith("require_"):
            return Role(name.removeprefix("require_"))
        pending.extend(dependant.dependencies)
    return None
