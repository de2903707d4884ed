"""API tokens in the store (hashed; the secret is returned once, at creation)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from sqlalchemy import ColumnElement, or_, select, update

from jobplane.auth import Role, TokenInfo, hash_secret, new_secret
from jobplane.errors import LastAdminError
from jobplane.ids import new_id
from jobplane.store.base import SqlBase, _aware
from jobplane.store.tables import api_tokens

token_cols = api_tokens.c

#: ``last_used_at`` is written when it is older than this: a token used all the time costs
#: one write a minute, not one per request.
TOUCH_EVERY = timedelta(seconds=60)


def _info(row: Mapping[Any, Any]) -> TokenInfo:
    return TokenInfo(
        id=row["id"],
        name=row["name"],
        role=Role(row["role"]),
        hint=row["hint"],
        created_at=row["created_at"],
        created_by=row["created_by"],
        revoked_at=row["revoked_at"],
        revoked_by=row["revoked_by"],
        expires_at=row["expires_at"],
        last_used_at=row["last_used_at"],
    )


class TokenStore(SqlBase):
    async def create_token(
        self, name: str, role: Role, actor: str, *, expires_in: timedelta | None = None
    ) -> tuple[TokenInfo, str]:
        """A new token, valid for ``expires_in`` from now (the database's clock) or until
        revoked; returns its info and the secret (the only time it is available)."""
        secret = new_secret()
        async with self._write() as conn:
            now = await self._now(conn)
            row = (
                await conn.execute(
                    api_tokens.insert()
                    .values(
                        id=new_id(),
                        name=name,
                        role=role.value,
                        token_hash=hash_secret(secret),
                        hint=secret[:7],
                        created_at=now,
                        created_by=actor,
                        expires_at=now + expires_in if expires_in is not None else None,
                    )
                    .returning(*api_tokens.c)
                )
            ).one()
        return _info(row._mapping), secret

    def _live(self) -> ColumnElement[bool]:
        return token_cols.revoked_at.is_(None) & or_(
            token_cols.expires_at.is_(None), token_cols.expires_at > self._clock()
        )

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
            row = (
                await conn.execute(select(api_tokens).where(token_cols.token_hash == token_hash))
            ).one()
        return _info(row._mapping), False

    async def authenticate(self, secret: str) -> TokenInfo | None:
        """The live token (not revoked, not expired) with this secret, if any. Notes its use
        when the last note is older than :data:`TOUCH_EVERY`."""
        async with self._write() as conn:
            row = (
                await conn.execute(
                    select(api_tokens, self._clock().label("now")).where(
                        token_cols.token_hash == hash_secret(secret), self._live()
                    )
                )
            ).first()
            if row is None:
                return None
            info = _info(row._mapping)
            now: datetime = row.now
            if info.last_used_at is None or _aware(now) - info.last_used_at >= TOUCH_EVERY:
                # Two processes may both write it in the same minute: harmless.
                await conn.execute(
                    update(api_tokens)
                    .where(token_cols.id == info.id)
                    .values(last_used_at=self._clock())
                )
        return info

    async def list_tokens(self) -> list[TokenInfo]:
        async with self._read() as conn:
            result = await conn.execute(select(api_tokens).order_by(token_cols.created_at))
            return [_info(r._mapping) for r in result]

    async def revoke_token(self, token_id: UUID, actor: str) -> bool:
        """Revoke a live token; False if there is none with this id. Raises LastAdminError
        rather than revoke the last live admin token."""
        async with self._write() as conn:
            # Lock every live admin token (in id order, the one lock order), so that two
            # admins revoking each other at once cannot both succeed and leave none.
            admins = (
                (
                    await conn.execute(
                        select(token_cols.id)
                        .where(token_cols.role == Role.ADMIN.value, self._live())
                        .order_by(token_cols.id)
                        .with_for_update()
                    )
                )
                .scalars()
                .all()
            )
            if list(admins) == [token_id]:
                raise LastAdminError(token_id)
            result = await conn.execute(
                update(api_tokens)
                .where(token_cols.id == token_id, token_cols.revoked_at.is_(None))
                .values(revoked_at=self._clock(), revoked_by=actor)
                .returning(token_cols.id)
            )
            return result.first() is not None
