"""Settings of the commands that are not a role of their own: ``jobplane migrate`` and
``jobplane dev`` (``JOBPLANE_*`` environment variables)."""

from __future__ import annotations

import re

from pydantic import SecretStr, field_validator

from jobplane.settings import CommonSettings
from jobplane_worker.settings import WorkerSettings


class MigrateSettings(CommonSettings):
    """``jobplane migrate``: the schema, and an admin token that a deployment provisions."""

    #: A secret (``jp_`` and at least 32 more URL-safe characters, e.g. from
    #: ``python -c 'import secrets; print("jp_" + secrets.token_urlsafe(32))'``) that
    #: ``jobplane migrate`` makes sure is an admin token, so a fresh deployment can be used
    #: without a manual step. Stored hashed like any token; revoke it once other tokens exist
    #: (a revoked one is never restored).
    bootstrap_admin_token: SecretStr | None = None

    @field_validator("bootstrap_admin_token")
    @classmethod
    def _bootstrap_admin_token(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value():
            return None
        if "change-me" in value.get_secret_value().lower():
            # The templates' placeholder (k8s/base/secret.example.yaml) is well-formed: left
            # as it is, it would become an admin token anyone who read the template knows.
            raise ValueError("is still the template's CHANGE-ME placeholder: set a random token")
        if not re.fullmatch(r"jp_[A-Za-z0-9_\-]{32,200}", value.get_secret_value()):
            raise ValueError("must be jp_ followed by at least 32 URL-safe characters")
        return value


class DevSettings(WorkerSettings):
    """``jobplane dev``: every role in one process on the embedded default."""
