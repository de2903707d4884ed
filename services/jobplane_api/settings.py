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
    #: Failed authentications one client (IP address) may make in a minute before getting
    #: 429 until the minute ends (0: no limit). Behind a proxy every client shares its address.
    auth_failures_per_minute: int = Field(default=30, ge=0)
    #: How long a secret found unknown is answered 401 without asking the database again.
    auth_negative_cache_s: float = Field(default=10.0, ge=0, le=3600)
    #: A /metrics answer is reused this long (two database statements and one Redis round
    #: trip per refresh).
    metrics_cache_s: float = Field(default=5.0, ge=0, le=300)
    #: Requests in flight each hold a connection: a bigger pool than the other roles'
    #: (per process: with ``api_workers`` processes the role opens that many pools).
    db_pool_size: int = Field(default=32, ge=1, le=1000)
    #: Processes serving the API on the one port (``jobplane api --workers``), each with its
    #: own event loop, store and bus connections; a supervisor process starts and stops them.
    api_workers: int = Field(default=1, ge=1, le=64)
