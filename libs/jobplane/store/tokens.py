"""API tokens in the store (hashed; the secret is returned once, at creation)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from uuid import UUID

from sqlalchemy import select, update

from jobplane.auth import Role, TokenInfo, hash_secret, new_secret
from jobplane.ids import new_id
from jobplane.store.base import SqlBase
from jobplane.store.tables import api_tokens

T = api_tokens.c


def _info(row: Mapping[Any, Any]) -> TokenInfo:
    return TokenInfo(
        id=row["id"],
        name=row["name"],
        role=Role(row["role"]),
        hint=row["hint"],
        created_at=row["created_at"],
        created_by=row["created_by"],
        revoked_at=row["revoked_at"],
    )


class TokenStore(SqlBase):
    async def create_token(self, name: str, role: Role, actor: str) -> tuple[TokenInfo, str]:
        """A new token; returns its info and the secret (the only time it is available)."""
        secret = new_secret()
        async with self._write() as conn:
            row = (
                await conn.execute(
                    api_tokens.insert()
                    .values(
                        id=new_id(),
                        name=name,
                        role=role.value,
                        token_hash=hash_secret(secret),
                        hint=secret[:7],
                        created_at=await self._now(conn),
                        created_by=actor,
                    )
                    .returning(*api_tokens.c)
                )
            ).one()
        return _info(row._mapping), secret

    async def ensure_token(
        self, secret: str, name: str, role: Role, actor: str
    ) -> tuple[TokenInfo, bool]:
        """The token with this (caller-chosen) secret, created with ``name`` and ``role`` if
        no token has it yet; ``(info, created)``. Idempotent, and safe when several processes
        run it at once (the hash is unique: a racing insert does nothing). An existing token
        is returned as it is, even revoked: a revocation is never undone here."""
        token_hash = hash_secret(secret)
        async with self._write() as conn:
            inserted = (
                await conn.execute(
                    self._insert(api_tokens)
                    .values(
                        id=new_id(),
                        name=name,
                        role=role.value,
                        token_hash=token_hash,
                        hint=secret[:7],
                        created_at=await self._now(conn),
                        created_by=actor,
                    )
                    .on_conflict_do_nothing(index_elements=["token_hash"])  # type: ignore[attr-defined]
                    .returning(*api_tokens.c)
                )
            ).first()
            if inserted is not None:
                return _info(inserted._mapping), True
            row = (await conn.execute(select(api_tokens).where(T.token_hash == token_hash))).one()
        return _info(row._mapping), False

    async def authenticate(self, secret: str) -> TokenInfo | None:
        """The live (not revoked) token with this secret, if any."""
        async with self._read() as conn:
            row = (
                await conn.execute(
                    select(api_tokens).where(
                        T.token_hash == hash_secret(secret), T.revoked_at.is_(None)
                    )
                )
            ).first()
        return _info(row._mapping) if row else None

    async def list_tokens(self) -> list[TokenInfo]:
        async with self._read() as conn:
            result = await conn.execute(select(api_tokens).order_by(T.created_at))
            return [_info(r._mapping) for r in result]

    async def revoke_token(self, token_id: UUID) -> bool:
        async with self._write() as conn:
            result = await conn.execute(
                update(api_tokens)
                .where(T.id == token_id, T.revoked_at.is_(None))
                .values(revoked_at=self._clock())
                .returning(T.id)
            )
            return result.first() is not None
