"""Login and logout: a token in, a session cookie out. The token is checked like a bearer
header (:func:`~jobplane_api.dashboard.session.token_of`): a wrong one counts against the
client's address, and a client over the limit gets 429 whatever it sends."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from starlette.responses import Response

from jobplane_api.dashboard.render import render, set_flash
from jobplane_api.dashboard.session import (
    Forbidden,
    SessionDep,
    checked,
    keep,
    new_anonymous,
    set_cookie,
    token_of,
)
from jobplane_api.deps import StoreDep

router = APIRouter(include_in_schema=False)

#: Token secrets are ~46 characters; anything much longer is not one.
TOKEN_MAX = 200


def safe_next(target: str | None) -> str:
    """Only a path of this site: never an open redirect to another one (browsers drop tabs
    and newlines and read a backslash as a slash: ``/<TAB>/evil`` would be ``//evil``)."""
    if not target or not target.startswith("/") or len(target) > 2000:
        return "/"
    if any(c.isspace() or ord(c) < 32 or c == "\\" for c in target) or target.startswith("//"):
        return "/"
    parts = urlsplit(target)
    return "/" if parts.scheme or parts.netloc else target


@router.get("/login", response_class=HTMLResponse)
async def login_form(
    request: Request, session: SessionDep, next: str = "/", ended: str = ""
) -> Response:
    """The sign-in form; ``ended`` (set by the redirect here) says the session's token was
    revoked or expired, on opening a page (``page``) or sending a form (``form``)."""
    if session.role is not None:
        return RedirectResponse(safe_next(next), status_code=303)
    notice = None
    if ended in ("page", "form"):
        notice = "Your session ended: its token is no longer valid (revoked or expired)."
        notice += " Sign in again."
        if ended == "form":
            notice += " What you sent was not done."
    context = {"next": safe_next(next), "error": None, "notice": notice}
    return await render(request, session, "login.html", context)


@router.post("/login", response_class=HTMLResponse)
async def login(
    request: Request,
    session: SessionDep,
    store: StoreDep,
    token: Annotated[str, Form(max_length=TOKEN_MAX)] = "",
    next: Annotated[str, Form(max_length=2000)] = "/",
) -> Response:
    await checked(request, session)
    if not session.auth_enabled and session.role is not None:
        return RedirectResponse(safe_next(next), status_code=303)
    secret = token.strip()
    found = await token_of(request, store, secret) if secret else None
    if found is None:
        # Never echo the secret back, not even into the form.
        context = {"next": safe_next(next), "error": "Unknown or revoked token."}
        return await render(request, session, "login.html", context, status=401)
    response = RedirectResponse(safe_next(next), status_code=303)
    set_cookie(response, request, secret)
    set_flash(response, "ok", f"Signed in as {found.name} ({found.role.value}).")
    return response


@router.post("/logout")
async def logout(request: Request, session: SessionDep) -> Response:
    if session.ended:  # its token was revoked or expired: signed out already
        return keep(RedirectResponse("/login", status_code=303), request, session)
    await checked(request, session)
    if session.role is None:
        raise Forbidden("you are not logged in")
    response = RedirectResponse("/login", status_code=303)
    set_cookie(response, request, new_anonymous())
    set_flash(response, "ok", "Signed out.")
    return response
