"""The dashboard's session cookie, roles and CSRF protection.

Design (documented in docs/dashboard.md):

- Every visitor holds one cookie, ``jp_session`` (httpOnly, SameSite=Lax, ``Secure`` over
  HTTPS, path ``/``, no expiry: it ends with the browser). Before login it holds a random
  nonce (``anon.<random>``); after login it holds the API token's secret itself. Each request
  checks the secret with the API's own :class:`~jobplane_api.authn.Authenticator` (a lookup
  of its SHA-256, live tokens never cached), so a revoked token ends its dashboard sessions
  at once, and several api replicas need no shared session table. The cookie is never
  readable by page scripts.
- The cookie and the login form share the API's failed-authentication throttle and negative
  cache: an unknown secret counts as a failure of the client's address (the session becomes
  anonymous and the answer replaces the cookie, so the browser stops sending it), and a
  client over the limit gets 429 (:class:`Throttled`) whatever secret it sends: neither is a
  way around the API's limit, nor an oracle for guessing secrets.
- CSRF: a synchronizer token derived from the cookie, ``HMAC-SHA256(cookie, label)``. Every
  form carries it in a hidden ``csrf`` field (scripts send it as ``X-CSRF-Token``); a POST
  whose token does not match its own cookie is refused with 403. Another site can neither
  read the cookie nor the page, so it cannot compute the token; the login form is protected
  the same way through the anonymous nonce.
- With ``auth_enabled`` off (``jobplane dev``) everyone is admin, as in the API, but the CSRF
  check still applies.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import urlsplit

from fastapi import Depends, Request
from starlette.responses import Response

from jobplane.auth import TOKEN_PREFIX, Role, TokenInfo
from jobplane.errors import JobplaneError
from jobplane.store.abc import ApiStore
from jobplane_api.authn import Authenticator, Refusal, client_of
from jobplane_api.deps import SettingsDep, StoreDep

COOKIE = "jp_session"
ANONYMOUS = "anon."
CSRF_FIELD = "csrf"
CSRF_HEADER = "x-csrf-token"
_CSRF_LABEL = b"jobplane-dashboard-csrf-v1"
#: A cookie longer than this is not ours (token secrets are ~46 characters).
_COOKIE_MAX = 200


class LoginRequired(JobplaneError):
    """The page needs a logged-in session; answered by a redirect to the login form, which
    says so when ``ended`` (the session's token was revoked or expired meanwhile), and that
    what was ``sent`` was not done."""

    def __init__(self, next_url: str, *, ended: bool = False, sent: bool = False) -> None:
        super().__init__(next_url)
        self.next_url = next_url
        self.ended = ended
        #: A form was sent (and not acted on) when the session was found ended.
        self.sent = sent


class Forbidden(JobplaneError):
    """A refused request: a role too low, or a CSRF token missing or wrong."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Throttled(JobplaneError):
    """The client has too many failed authentications this minute (the API's limit): 429."""

    def __init__(self, reason: str, retry_after: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


@dataclass(frozen=True, slots=True)
class Session:
    """Who is looking: ``role`` is None until logged in."""

    cookie: str
    new: bool  # the cookie must be set on the response
    role: Role | None
    token: TokenInfo | None  # None when auth is off or nobody is logged in
    auth_enabled: bool
    #: The cookie held a token's secret that no longer signs in (revoked or expired).
    ended: bool = False

    @property
    def csrf(self) -> str:
        return csrf_token(self.cookie)

    @property
    def name(self) -> str:
        if self.token is not None:
            return self.token.name
        return "anonymous" if self.role is None else "local (auth off)"

    def can(self, role: Role) -> bool:
        """Whether a control needing ``role`` is shown and allowed."""
        return self.role is not None and self.role.allows(role)


def csrf_token(cookie: str) -> str:
    return hmac.new(cookie.encode(), _CSRF_LABEL, hashlib.sha256).hexdigest()


def new_anonymous() -> str:
    return ANONYMOUS + secrets.token_urlsafe(24)


async def get_session(request: Request, store: StoreDep, settings: SettingsDep) -> Session:
    session = await _session_of(request, store, settings.auth_enabled)
    # For the error pages (LoginRequired, Forbidden), which set a new cookie too: a browser
    # holding a revoked token's secret stops sending it (its polling would count a failure
    # of its address every few seconds otherwise).
    request.state.dashboard_session = session
    return session


async def _session_of(request: Request, store: ApiStore, auth_enabled: bool) -> Session:
    cookie = request.cookies.get(COOKIE, "")
    if not cookie or len(cookie) > _COOKIE_MAX:
        return Session(new_anonymous(), True, _open_role(auth_enabled), None, False)
    if not auth_enabled:
        return Session(cookie, False, Role.ADMIN, None, False)
    if not cookie.startswith(TOKEN_PREFIX):  # an anonymous nonce (nothing to look up)
        return Session(cookie, False, None, None, True)
    token = await token_of(request, store, cookie)
    if token is None:  # unknown, or revoked meanwhile: back to an anonymous session
        return Session(new_anonymous(), True, None, None, True, ended=True)
    return Session(cookie, False, token.role, token, True)


async def token_of(request: Request, store: ApiStore, secret: str) -> TokenInfo | None:
    """The live token with the secret ``secret``, checked by the API's Authenticator (the
    same negative cache and per-client limit as a bearer header); None when it is unknown,
    revoked or expired, which counts as a failure of the client. Raises Throttled while the
    client is over its limit."""
    authenticator: Authenticator = request.app.state.authenticator
    try:
        return await authenticator.authenticate_secret(store, secret, client_of(request.scope))
    except Refusal as refusal:
        if refusal.status == 429:
            raise Throttled(refusal.detail, refusal.headers["Retry-After"]) from None
        return None


def session_of(request: Request) -> Session | None:
    """The session :func:`get_session` found for ``request``, if it got that far."""
    session: Session | None = getattr(request.state, "dashboard_session", None)
    return session


def _open_role(auth_enabled: bool) -> Role | None:
    return None if auth_enabled else Role.ADMIN


SessionDep = Annotated[Session, Depends(get_session)]


def viewer(request: Request, session: SessionDep) -> Session:
    """A page: any logged-in role; otherwise a redirect to the login form."""
    if session.role is None:
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        raise LoginRequired(target, ended=session.ended)
    return session


ViewerDep = Annotated[Session, Depends(viewer)]


async def checked(request: Request, session: Session) -> None:
    """Refuse a state-changing request whose CSRF token does not match its cookie."""
    sent = request.headers.get(CSRF_HEADER)
    if sent is None:
        form = await request.form()
        value = form.get(CSRF_FIELD)
        sent = value if isinstance(value, str) else None
    # Compared as bytes: compare_digest refuses str with non-ASCII characters (a 500).
    if session.new or not sent or not hmac.compare_digest(sent.encode(), session.csrf.encode()):
        raise Forbidden("the form's security token is missing or stale; reload the page")


def require(role: Role) -> Any:
    """A state-changing request: CSRF checked first, then ``role``."""

    async def check(request: Request, session: SessionDep) -> Session:
        if session.ended:
            # Said as such, not as the stale form token it also is: sign in again, and come
            # back to the page the form was on.
            raise LoginRequired(_page_of(request), ended=True, sent=True)
        await checked(request, session)
        if session.role is None:
            raise Forbidden("you are not logged in")
        if not session.role.allows(role):
            raise Forbidden(f"this needs the {role.value} role; you are {session.role.value}")
        return session

    check.__name__ = f"dashboard_require_{role.value}"
    return Depends(check)


def _page_of(request: Request) -> str:
    """The page of this site a form was sent from (its Referer), or the Overview."""
    referer = urlsplit(request.headers.get("referer", ""))
    if referer.netloc != request.headers.get("host") or not referer.path.startswith("/"):
        return "/"
    return referer.path + (f"?{referer.query}" if referer.query else "")


OperatorDep = Annotated[Session, require(Role.OPERATOR)]
AdminDep = Annotated[Session, require(Role.ADMIN)]


def set_cookie(response: Response, request: Request, value: str) -> None:
    response.set_cookie(
        COOKIE,
        value,
        httponly=True,
        samesite="lax",
        secure=request.url.scheme == "https",
        path="/",
    )


def keep(response: Response, request: Request, session: Session) -> Response:
    """Set the session cookie on ``response`` when the session is new."""
    if session.new:
        set_cookie(response, request, session.cookie)
    return response
