"""The interactive API docs (Swagger UI at ``/docs``, ReDoc at ``/redoc``), served with their
assets from the installed ``fastapi-offline`` package: nothing is loaded from a CDN, so the
docs work on a cluster without internet access, and each page carries a Content-Security-Policy
that allows only its own assets and its one inline script (by hash)."""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path

import fastapi_offline
from fastapi import FastAPI
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS = "/docs/assets"
ASSET_DIR = Path(fastapi_offline.__file__).parent / "static"
_INLINE_SCRIPT = re.compile(r"<script>(.*?)</script>", re.DOTALL)


def install(app: FastAPI, openapi_url: str = "/openapi.json") -> None:
    """Add ``/docs``, ``/docs/oauth2-redirect``, ``/redoc`` and the assets to ``app`` (made
    with ``docs_url=None, redoc_url=None``)."""
    app.mount(ASSETS, StaticFiles(directory=ASSET_DIR), name="docs-assets")
    swagger = _with_csp(
        get_swagger_ui_html(
            openapi_url=openapi_url,
            title=f"{app.title} — API docs",
            swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS}/favicon.png",
            oauth2_redirect_url="/docs/oauth2-redirect",
            swagger_ui_parameters={"persistAuthorization": False},
        )
    )
    redoc = _with_csp(
        get_redoc_html(
            openapi_url=openapi_url,
            title=f"{app.title} — API reference",
            redoc_js_url=f"{ASSETS}/redoc.standalone.js",
            redoc_favicon_url=f"{ASSETS}/favicon.png",
            with_google_fonts=False,
        )
    )
    redirect = _with_csp(get_swagger_ui_oauth2_redirect_html())

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return swagger

    @app.get("/docs/oauth2-redirect", include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return redirect

    @app.get("/redoc", include_in_schema=False)
    async def redoc_page() -> HTMLResponse:
        return redoc


def _with_csp(page: HTMLResponse) -> HTMLResponse:
    """``page`` with a policy that allows its inline scripts by their SHA-256 and nothing
    from elsewhere (inline styles are allowed: both UIs set them at run time)."""
    hashes = " ".join(
        f"'sha256-{base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()}'"
        for s in _INLINE_SCRIPT.findall(bytes(page.body).decode())
    )
    policy = (
        f"default-src 'self'; script-src 'self' {hashes}; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data:; worker-src 'self' blob:; connect-src 'self'; "
        "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
    )
    return HTMLResponse(page.body, headers={"Content-Security-Policy": policy})
