"""API tokens: list, create (the secret is in the answer, once), revoke. Admin only."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Annotated
from uuid import UUID

from fastapi import APIRouter, HTTPException, Response, status
from pydantic import BaseModel, ConfigDict, Field

from jobplane.auth import MAX_TOKEN_LIFETIME_S, MIN_TOKEN_LIFETIME_S, Role, TokenInfo
from jobplane_api.deps import StoreDep
from jobplane_api.inputs import ShortText
from jobplane_api.schemas import PROBLEM_RESPONSES
from jobplane_api.security import Admin, Principal, actor_of

#: Ten years.

router = APIRouter(prefix="/api/v1/tokens", tags=["tokens"], responses=PROBLEM_RESPONSES)


class TokenOut(BaseModel):
    id: UUID
    name: str
    role: Role
    hint: str = Field(description="The first characters of the secret, to recognise it.")
    created_at: datetime
    created_by: str
    revoked_at: datetime | None
    revoked_by: str | None = Field(
        description="Who revoked it: `token:<name>` of the revoking token (`cli`: "
        "`jobplane token revoke`); null while live."
    )
    expires_at: datetime | None = Field(description="Null: valid until revoked.")
    last_used_at: datetime | None = Field(
        description="When it last authenticated a request (updated about once a minute)."
    )

    @classmethod
    def of(cls, t: TokenInfo) -> TokenOut:
        return cls(
            id=t.id,
            name=t.name,
            role=t.role,
            hint=t.hint,
            created_at=t.created_at,
            created_by=t.created_by,
            revoked_at=t.revoked_at,
            revoked_by=t.revoked_by,
            expires_at=t.expires_at,
            last_used_at=t.last_used_at,
        )


class TokenIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: ShortText = Field(min_length=1)
    role: Role
    expires_in_s: int | None = Field(
        default=None,
        ge=MIN_TOKEN_LIFETIME_S,
        le=MAX_TOKEN_LIFETIME_S,
        description="Seconds until it stops working; omitted: until revoked.",
    )


class NewTokenOut(TokenOut):
    secret: str = Field(description="Shown once: store it now. Only its hash is kept.")


@router.get("", summary="List tokens", response_model=list[TokenOut], dependencies=[Admin])
async def list_tokens(store: StoreDep) -> list[TokenOut]:
    """Every token, revoked ones included (never their secrets)."""
    return [TokenOut.of(t) for t in await store.list_tokens()]


TOKEN_EXAMPLE = {"name": "ci-deploy", "role": "operator", "expires_in_s": 2592000}


@router.post(
    "",
    summary="Create a token",
    status_code=status.HTTP_201_CREATED,
    response_model=NewTokenOut,
    openapi_extra={"requestBody": {"content": {"application/json": {"example": TOKEN_EXAMPLE}}}},
)
async def create_token(
    store: StoreDep, body: TokenIn, principal: Annotated[Principal, Admin], response: Response
) -> NewTokenOut:
    """A new bearer token with a role, valid until revoked or for ``expires_in_s``; the
    secret is returned in this answer only (marked ``Cache-Control: no-store``)."""
    expires_in = timedelta(seconds=body.expires_in_s) if body.expires_in_s else None
    info, secret = await store.create_token(
        body.name, body.role, actor_of(principal), expires_in=expires_in
    )
    response.headers["Cache-Control"] = "no-store"
    return NewTokenOut(**TokenOut.of(info).model_dump(), secret=secret)


@router.delete(
    "/{token_id}",
    summary="Revoke a token",
    status_code=status.HTTP_204_NO_CONTENT,
)
async def revoke_token(
    store: StoreDep, token_id: UUID, principal: Annotated[Principal, Admin]
) -> None:
    """Revoked at once: the next request with it is refused; ``revoked_by`` records the
    revoking token's name. Revoking the last live admin token is a 409 (create another admin
    token first)."""
    if not await store.revoke_token(token_id, actor_of(principal)):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no live token {token_id}")
