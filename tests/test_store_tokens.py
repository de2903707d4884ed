"""Token lifecycle in the store, on both backends: expiry, last use written at most once a
minute, the last live admin kept."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import update

from jobplane.auth import Role
from jobplane.errors import LastAdminError
from jobplane.store.sql import SqlStore
from jobplane.store.tables import api_tokens


async def test_expiry_and_last_use(store: SqlStore) -> None:
    info, secret = await store.create_token("t", Role.VIEWER, "test", expires_in=timedelta(hours=1))
    assert info.expires_at is not None and info.last_used_at is None
    assert info.expires_at - info.created_at == timedelta(hours=1)
    first = await store.authenticate(secret)
    assert first is not None
    [listed] = await store.list_tokens()
    assert listed.last_used_at is not None
    noted = listed.last_used_at
    await store.authenticate(secret)
    assert (await store.list_tokens())[0].last_used_at == noted  # not again within a minute
    async with store.engine.begin() as conn:
        await conn.execute(update(api_tokens).values(last_used_at=noted - timedelta(minutes=2)))
    await store.authenticate(secret)
    used = (await store.list_tokens())[0].last_used_at
    assert used is not None and used >= noted
    async with store.engine.begin() as conn:
        await conn.execute(
            update(api_tokens).values(expires_at=info.created_at - timedelta(seconds=1))
        )
    assert await store.authenticate(secret) is None


async def test_the_last_live_admin_is_kept(store: SqlStore) -> None:
    first, _ = await store.create_token("a1", Role.ADMIN, "test")
    viewer, _ = await store.create_token("v", Role.VIEWER, "test")
    with pytest.raises(LastAdminError):
        await store.revoke_token(first.id, "test")
    assert await store.revoke_token(viewer.id, "test")
    second, _ = await store.create_token("a2", Role.ADMIN, "test")
    assert await store.revoke_token(first.id, "test")
    # An expired admin does not count as live.
    expired, _ = await store.create_token("a3", Role.ADMIN, "test", expires_in=timedelta(0))
    with pytest.raises(LastAdminError):
        await store.revoke_token(second.id, "test")
    assert not await store.revoke_token(first.id, "test")  # already revoked
    assert expired.id != second.id
