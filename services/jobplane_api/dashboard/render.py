"""Templates (Jinja2, autoescaped) and the filters the pages use."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote
from zoneinfo import ZoneInfo

from cron_descriptor import FormatException, Options, get_description
from fastapi import Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates
from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.responses import Response

from jobplane import __version__
from jobplane.domain.states import InstanceState
from jobplane_api.dashboard.session import Session, keep

HERE = Path(__file__).parent
FLASH = "jp_flash"
#: Every page: scripts, styles and forms of this site only, never framed (clickjacking).
HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": "default-src 'self'; base-uri 'none'; object-src 'none'; "
    "form-action 'self'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}


def cron_words(expression: str | None) -> str:
    """The expression in English. Jobplane's sixth field is seconds, which cron-descriptor
    expects first."""
    if not expression:
        return "Manual trigger only"
    parts = expression.split()
    if len(parts) == 6:
        parts = [parts[5], *parts[:5]]
    options = Options()
    options.use_24hour_time_format = True
    options.verbose = False
    try:
        return str(get_description(" ".join(parts), options))
    except (FormatException, ValueError, KeyError, IndexError):
        return expression


def utc(moment: datetime | None) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") if moment else "—"


def iso(moment: datetime | None) -> str:
    return moment.astimezone(UTC).isoformat() if moment else ""


def in_zone(moment: datetime | None, zone: str) -> str:
    if moment is None:
        return "—"
    return moment.astimezone(ZoneInfo(zone)).strftime("%Y-%m-%d %H:%M:%S %Z")


def ago(moment: datetime | None, now: datetime) -> str:
    """How long before ``now`` (or after it, for a future time), coarsely."""
    if moment is None:
        return "never"
    seconds = (now - moment).total_seconds()
    future = seconds < 0
    text = duration(abs(seconds))
    return f"in {text}" if future else f"{text} ago"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds // 60:.0f} min {seconds % 60:.0f} s"
    if seconds < 86400:
        return f"{seconds // 3600:.0f} h {seconds % 3600 // 60:.0f} min"
    return f"{seconds // 86400:.0f} d {seconds % 86400 // 3600:.0f} h"


def pretty(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=False, default=str)


def first_line(text: str | None) -> str:
    return (text or "").strip().splitlines()[0] if (text or "").strip() else ""


def percent(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.0f}%"


def _environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(HERE / "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        cron_words=cron_words,
        utc=utc,
        iso=iso,
        in_zone=in_zone,
        duration=duration,
        pretty=pretty,
        first_line=first_line,
        percent=percent,
    )
    env.globals.update(ago=ago, version=__version__, STATES=list(InstanceState))
    return env


templates = Jinja2Templates(env=_environment())


async def render(
    request: Request,
    session: Session,
    name: str,
    context: dict[str, Any],
    *,
    status: int = 200,
) -> HTMLResponse:
    """A page or a fragment, with what every template needs; the session cookie is set when
    new and a flash message, once shown, is cleared."""
    flash = read_flash(request)
    response = templates.TemplateResponse(
        request,
        name,
        {"session": session, "flash": flash, "scope": _scope(context.get("app")), **context},
        status_code=status,
        headers=HEADERS,
    )
    if flash is not None:
        response.delete_cookie(FLASH, path="/")
    keep(response, request, session)
    return response


def error_page(
    request: Request, status: int, title: str, detail: str, headers: dict[str, str] | None = None
) -> HTMLResponse:
    """The error page (no session shown: the refusal may come before one is known)."""
    context = {"session": None, "flash": None, "title": title, "detail": detail}
    return templates.TemplateResponse(
        request, "error.html", context, status_code=status, headers={**HEADERS, **(headers or {})}
    )


def _scope(app: object) -> str:
    """The URL prefix of the pages of one app's scope ("" for every app)."""
    return f"/apps/{quote(app, safe='')}" if isinstance(app, str) and app else ""


#: A flash message is cut to this many characters: a browser drops a cookie over 4,096
#: bytes, and the message with it ("Not retried: " and a refusal quoting 5,000 characters of
#: arguments left the page saying nothing).
FLASH_MAX = 400
#: ... and to this many bytes of JSON (a character outside the Basic Multilingual Plane, an
#: emoji, is 12: 400 of them overflowed), so that in base64 it stays under the 4,000
#: characters :func:`read_flash` takes.
FLASH_JSON_MAX = 2_800


def set_flash(response: Response, kind: str, text: str) -> None:
    """A message shown once on the next page (after a POST's redirect), cut to
    :data:`FLASH_MAX` characters and :data:`FLASH_JSON_MAX` bytes."""
    value = base64.urlsafe_b64encode(json.dumps([kind, _cut(text)]).encode()).decode()
    response.set_cookie(FLASH, value, httponly=True, samesite="lax", path="/", max_age=60)


def _cut(text: str) -> str:
    if len(text) > FLASH_MAX:
        text = text[: FLASH_MAX - 1] + "…"
    used = 0
    for i, char in enumerate(text):
        used += len(json.dumps(char)) - 2  # (what the character costs escaped)
        if used > FLASH_JSON_MAX:
            return text[: i - 1] + "…"
    return text


def read_flash(request: Request) -> dict[str, str] | None:
    raw = request.cookies.get(FLASH)
    if not raw or len(raw) > 4000:
        return None
    try:
        kind, text = json.loads(base64.urlsafe_b64decode(raw.encode()))
    except (ValueError, TypeError, RecursionError):  # the client's cookie: "[[[…" too
        return None
    if kind not in ("ok", "error") or not isinstance(text, str):
        return None
    return {"kind": kind, "text": text}
