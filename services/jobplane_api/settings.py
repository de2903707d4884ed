"""Settings of the api role (``JOBPLANE_*`` environment variables)."""

from __future__ import annotations

from pydantic import Field

from jobplane.settings import CommonSettings


class ApiSettings(CommonSettings):
    host: str = "0.0.0.0"
    port: int = Field(default=8000, ge=0, le=65535)
    #: Requests larger than this are refused with 413 before they are read.
    max_body_bytes: int = Field(default=1_048_576, ge=1024)
    #: Bearer tokens are required unless this is off (``jobplane dev`` turns it off).
    auth_enabled: bool = True
    #: Requests in flight each hold a connection: a bigger pool than the other roles'.
    db_pool_size: int = Field(default=32, ge=1, le=1000)
