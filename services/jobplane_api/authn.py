"""Authentication before anything else: a request to ``/api/`` is authenticated by a plain
ASGI middleware before its body is read or validated, so a caller without a valid token only
ever learns 401 (or 429), whatever it sends. The route's role is then checked by
``jobplane_api.security.require``, which finds the principal here.

Failed authentications are cheap to refuse: a secret found unknown is remembered for a few
seconds (no second database lookup), and a client with too many failures in a minute gets 429
until the minute is over. Live tokens are never cached, so a revocation takes effect at once.
The dashboard's login form and session cookie check their secrets with the same
:class:`Authenticator` (:meth:`Authenticator.authenticate_secret`): one limit per client.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from jobplane.auth import TokenInfo, hash_secret
from jobplane.errors import JobplaneError, UnavailableError
from jobplane.store.abc import ApiStore
from jobplane_api import problems

logger = logging.getLogger(__name__)

#: Where the middleware leaves the authenticated token in the request's scope state.
PRINCIPAL = "jobplane_principal"
CHALLENGE = {"WWW-Authenticate": "Bearer"}
#: Remembered unknown secrets at most (oldest forgotten first).
NEGATIVE_CACHE_SIZE = 10_000
#: Clients whose failures are counted at most (oldest window forgotten first).
CLIENTS_TRACKED = 10_000


@dataclass(frozen=True)
class Refusal(JobplaneError):
    status: int
    detail: str
    headers: dict[str, str]


class Authenticator:
    """Checks bearer secrets against the store with a negative cache and a per-client limit
    on failures. One per app; its memory is bounded."""

    def __init__(
        self,
        *,
        failures_per_minute: int,
        negative_ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failures_per_minute = failures_per_minute
        self.negative_ttl_s = negative_ttl_s
        self.clock = clock
        self._unknown: OrderedDict[str, float] = OrderedDict()  # hash -> forget at
        self._failures: OrderedDict[str, tuple[float, int]] = OrderedDict()  # window start, n

    async def authenticate(
        self, store: ApiStore, authorization: str | None, client: str
    ) -> TokenInfo:
        """The live token of an ``Authorization: Bearer …`` header; raises Refusal (401, or
        429 for a client over its failure limit)."""
        scheme, _, secret = (authorization or "").partition(" ")
        secret = secret.strip()
        if scheme.lower() != "bearer" or not secret:
            raise Refusal(401, "a bearer token is required", CHALLENGE)
        return await self.authenticate_secret(store, secret, client)

    async def authenticate_secret(self, store: ApiStore, secret: str, client: str) -> TokenInfo:
        """The live token with the secret ``secret``, sent by ``client`` (its address); raises
        Refusal: 429 while the client is over its failure limit (before any lookup, whatever
        the secret), else 401 for a secret unknown, revoked or expired, which counts as a
        failure of the client. Every way in (a bearer header, the dashboard's login form and
        session cookie) checks secrets here, so their failures count together."""
        self._check_throttle(client)
        digest = hash_secret(secret)
        now = self.clock()
        forget_at = self._unknown.get(digest)
        token = None
        if forget_at is None or forget_at <= now:
            # Looked up by the secret's SHA-256 in SQL (see jobplane.auth.hash_secret).
            token = await store.authenticate(secret)
        if token is None:
            self._remember_unknown(digest, now)
            self._count_failure(client, now)
            # Never echo or log the secret.
            raise Refusal(401, "unknown, revoked or expired token", CHALLENGE)
        return token

    def _check_throttle(self, client: str) -> None:
        if self.failures_per_minute <= 0:
            return
        window = self._failures.get(client)
        now = self.clock()
        if window is None or now - window[0] >= 60:
            return
        if window[1] >= self.failures_per_minute:
            retry_after = max(1, math.ceil(60 - (now - window[0])))
            raise Refusal(
                429,
                f"too many failed authentications from this client; retry in {retry_after} s",
                {"Retry-After": str(retry_after)},
            )

    def _remember_unknown(self, digest: str, now: float) -> None:
        if self.negative_ttl_s <= 0:
            return
        self._unknown[digest] = now + self.negative_ttl_s
        self._unknown.move_to_end(digest)
        while len(self._unknown) > NEGATIVE_CACHE_SIZE:
            self._unknown.popitem(last=False)

    def _count_failure(self, client: str, now: float) -> None:
        start, count = self._failures.get(client, (now, 0))
        if now - start >= 60:
            start, count = now, 0
        self._failures[client] = (start, count + 1)
        self._failures.move_to_end(client)
        while len(self._failures) > CLIENTS_TRACKED:
            self._failures.popitem(last=False)
        if count + 1 == self.failures_per_minute:
            logger.warning(
                "client %s reached %d failed authentications in a minute; throttled",
                client,
                count + 1,
                extra={"action": "api.auth_throttled", "client": client},
            )


def client_of(scope: Scope) -> str:
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


class AuthenticateFirst:
    """Authenticates every ``/api/`` request before the app reads its body (plain ASGI:
    nothing is received before the answer is known)."""

    def __init__(self, app: ASGIApp, authenticator: Authenticator, prefix: str = "/api/") -> None:
        self.app = app
        self.authenticator = authenticator
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            await self.app(scope, receive, send)
            return
        store: ApiStore = scope["app"].state.store
        header = Headers(scope=scope).get("authorization")
        try:
            token = await self.authenticator.authenticate(store, header, client_of(scope))
        except Refusal as refusal:
            title = "Unauthorized" if refusal.status == 401 else "Too Many Requests"
            response = problems.problem(
                refusal.status, title, refusal.detail, request=Request(scope)
            )
            response.headers.update(refusal.headers)
            await response(scope, receive, send)
            return
        except UnavailableError as exc:
            logger.warning("%s", exc, extra={"action": "api.unavailable"})
            response = problems.problem(
                503, "Service unavailable", "the store is unreachable", request=Request(scope)
            )
            await response(scope, receive, send)
            return
        scope.setdefault("state", {})[PRINCIPAL] = token
        await self.app(scope, receive, send)


#: Methods a browser sends across sites without asking first (a form, a fetch ``no-cors``)
#: that change something here.
UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


class SameSiteOnly:
    """Without authentication (``jobplane dev``, ``JOBPLANE_AUTH_ENABLED=false``) nothing
    tells this api's own callers from a web page the developer happens to visit: the page's
    form could post to ``/api/v1/jobs/{key}/pause`` or ``/instances/{id}/cancel`` (no body,
    no preflight), and, served on a loopback address, a page whose name it rebinds to
    127.0.0.1 could read and trigger at will. So, with auth off, a request that changes
    something is refused (403) when the browser says it comes from another site (an
    ``Origin`` not this host, or ``Sec-Fetch-Site: cross-site``/``same-site``); and an api
    served on a loopback address answers only requests that name a loopback host
    (``localhost``, ``127.0.0.1``, ``[::1]``), which a rebound name is not. Scripts and the
    command line send neither header and are not concerned."""

    def __init__(self, app: ASGIApp, served_on: str) -> None:
        self.app = app
        self.loopback_only = _is_loopback(served_on)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # (The raw headers, read once: on every request of a dev api.)
        host = origin = site = None
        for name, value in scope["headers"]:
            if name == b"host":
                host = value.decode("latin-1")
            elif name == b"origin":
                origin = value.decode("latin-1")
            elif name == b"sec-fetch-site":
                site = value.decode("latin-1")
        host = host or ""
        refusal: str | None = None
        if self.loopback_only and not _is_loopback_host(host):
            refusal = f"this api answers its own host only, not {host[:100]!r}"
        elif scope["method"] in UNSAFE_METHODS and (
            site in ("cross-site", "same-site")
            or (origin is not None and origin.partition("://")[2] != host)
        ):
            refusal = "a request from another site (authentication is off)"
        if refusal is None:
            await self.app(scope, receive, send)
            return
        response = problems.problem(403, "Forbidden", refusal, request=Request(scope))
        await response(scope, receive, send)


@functools.lru_cache(maxsize=256)
def _is_loopback_host(host: str) -> bool:
    """Whether a ``Host`` header names a loopback host (remembered: it is the same on every
    request)."""
    return _is_loopback(_host_name(host))


def _host_name(host: str) -> str:
    """The name in a ``Host`` header, without its port (``[::1]:8000`` is ``::1``)."""
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def _is_loopback(name: str) -> bool:
    """Whether ``name`` is ``localhost`` or a loopback address (``127.0.0.1.evil.example``,
    a name, is not)."""
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
