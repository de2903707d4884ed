"""Bearer-token authentication and role checks for the API.

Every route but health, readiness and metrics declares the role it needs with
``Depends(require(Role.X))``; ``tests/test_api_auth.py`` walks the route table so that a new
route cannot slip through unprotected.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, Header, HTTPException, status

from jobplane.auth import Role, TokenInfo
from jobplane_api.deps import SettingsDep, StoreDep

Principal = TokenInfo | None  # None: auth is disabled (jobplane dev)

CHALLENGE = {"WWW-Authenticate": "Bearer"}


def require(role: Role) -> Callable[..., Awaitable[Principal]]:
    async def check(
        store: StoreDep,
        settings: SettingsDep,
        authorization: Annotated[str | None, Header(include_in_schema=False)] = None,
    ) -> Principal:
        if not settings.auth_enabled:
            return None
        scheme, _, secret = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not secret:
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED, "a bearer token is required", headers=CHALLENGE
            )
        # Looked up by the secret's SHA-256 in SQL: the secret is never compared itself, so
        # a timing difference can only concern the hash (see jobplane.auth.hash_secret).
        token = await store.authenticate(secret.strip())
        if token is None:
            # Never echo or log the secret.
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED, "unknown or revoked token", headers=CHALLENGE
            )
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
