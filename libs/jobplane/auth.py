"""API tokens and roles: viewer (read) < operator (trigger, cancel, retry, pause) < admin
(edit options, manage tokens). Secrets are random, shown once, stored as SHA-256 only."""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from uuid import UUID

from jobplane.domain.limits import check_text
from jobplane.errors import InvalidOptionsError

TOKEN_PREFIX = "jp_"


class Role(StrEnum):
    VIEWER = "viewer"
    OPERATOR = "operator"
    ADMIN = "admin"

    def allows(self, needed: Role) -> bool:
        return ORDER[self] >= ORDER[needed]


ORDER = {Role.VIEWER: 0, Role.OPERATOR: 1, Role.ADMIN: 2}


@dataclass(frozen=True, slots=True)
class TokenInfo:
    id: UUID
    name: str
    role: Role
    hint: str
    created_at: datetime
    created_by: str
    revoked_at: datetime | None = None
    revoked_by: str | None = None
    expires_at: datetime | None = None
    last_used_at: datetime | None = None


def new_secret() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_secret(secret: str) -> str:
    """SHA-256 hex. Secrets carry 256 bits of randomness, so a fast hash is the right one.

    A token is found by this hash in SQL (an indexed equality), never by comparing secrets in
    Python, so no constant-time comparison is needed: timing can at most reveal how much of a
    *hash* matched a stored one, and SHA-256 of an attacker's guess tells nothing about the
    preimage of a stored hash (finding a secret from it is a preimage search on 256 bits)."""
    return hashlib.sha256(secret.encode()).hexdigest()


_DURATION = re.compile(r"\A(\d{1,6})([smhd])\Z")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> timedelta:
    """``90s``, ``15m``, ``12h`` or ``30d`` as a timedelta; ValueError otherwise."""
    match = _DURATION.match(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not a duration like 90s, 15m, 12h or 30d")
    return timedelta(seconds=int(match[1]) * _UNIT_S[match[2]])


#: A token's lifetime, when it has one: a minute to ten years (the API and the CLI alike).
MIN_TOKEN_LIFETIME_S = 60
MAX_TOKEN_LIFETIME_S = 10 * 365 * 24 * 3600
TOKEN_NAME_MAX = 200


def check_token_request(name: str, lifetime: timedelta | None) -> None:
    """InvalidOptionsError (naming ``name`` or ``expires_in``) unless ``name`` (1 to 200
    characters of storable text) and ``lifetime`` (none, or a minute to ten years) are what the
    API takes: ``jobplane token create`` made an admin token expired at birth (``--expires-in
    0d``), a nameless one, or failed in the database."""
    if not name.strip() or len(name) > TOKEN_NAME_MAX:
        raise InvalidOptionsError("name", f"the name must be 1 to {TOKEN_NAME_MAX} characters")
    check_text(name, "name")
    if lifetime is not None and not (
        MIN_TOKEN_LIFETIME_S <= lifetime.total_seconds() <= MAX_TOKEN_LIFETIME_S
    ):
        raise InvalidOptionsError(
            "expires_in", "the lifetime must be from a minute (60s, 1m) to ten years (3650d)"
        )
