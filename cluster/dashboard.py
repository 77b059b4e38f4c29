"""GET /dashboard: a live page of the stages, served by the same app on the same port.

The page (static/dashboard.html + dashboard.js) polls GET /v1/stages and draws, per stage, the
measured expert-cache hit rate beside the plan's prediction, tokens/s, step time, KV use and the
layer split, with uPlot (MIT, vendored in static/: the page needs nothing but this server, so it
works offline and behind a firewall).

The API key, for a browser: a browser cannot add an `Authorization` header to a page it opens, so
with --api-key the page is opened once as `/dashboard?key=KEY`. The server checks the key, sets it
as a cookie (HttpOnly: the page's scripts never see it; SameSite=Strict: no other site's page can
make the browser send it) and redirects to `/dashboard`, so the key leaves the address bar and the
history. The cookie then admits the page and its polls of GET /v1/stages, and nothing else: every
other /v1 route still wants the header. Without --api-key the page is open like the rest.
"""
from __future__ import annotations

import hmac
from pathlib import Path
from typing import Optional
from urllib.parse import urlencode

from fastapi import Request  # at module level: FastAPI resolves the route's annotations here

STATIC = Path(__file__).resolve().parent / "static"
COOKIE = "moeray_key"
# The one route the cookie opens: read-only numbers, what the page polls.
COOKIE_ROUTES = frozenset({"/v1/stages"})


def _same(given: Optional[str], key: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), key.encode())


class CookieKey:
    """ASGI middleware: a GET of a COOKIE_ROUTES path with no Authorization header but the key
    cookie gets that cookie as its bearer token, so the server's one key check judges it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "GET" and scope["path"] in COOKIE_ROUTES:
            headers = scope["headers"]
            if not any(name == b"authorization" for name, _ in headers):
                from starlette.requests import cookie_parser

                cookie = b"; ".join(v for name, v in headers if name == b"cookie").decode("latin-1")
                key = cookie_parser(cookie).get(COOKIE) if cookie else None
                if key:
                    scope = dict(scope, headers=[*headers, (b"authorization", f"Bearer {key}".encode("latin-1"))])
        await self.app(scope, receive, send)


def _refusal(status: int, why: str):
    """A small HTML page that says what is wrong and how to open the page."""
    from fastapi.responses import HTMLResponse

    body = (f"<!doctype html><meta charset='utf-8'><title>moeray: {status}</title>"
            f"<body style='font-family:sans-serif;margin:2em'><h1>{status}</h1><p>{why}</p>"
            "<p>Open <code>/dashboard?key=YOUR_API_KEY</code> once (the key given to <code>moeray serve "
            "--api-key</code> or in <code>$MOERAY_API_KEY</code>); the browser keeps it in a cookie.</p></body>")
    return HTMLResponse(body, status_code=status)


def add_dashboard(app, api_key: Optional[str]) -> None:
    """Add GET /dashboard, its static files under /dashboard/static, and (with a key) the cookie
    middleware. Call after the app's own middleware so the cookie is read before the key check."""
    from fastapi.responses import FileResponse, RedirectResponse
    from fastapi.staticfiles import StaticFiles

    page = STATIC / "dashboard.html"
    if api_key:
        app.add_middleware(CookieKey)
    app.mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard-static")

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard(request: Request):
        no_cache = {"Cache-Control": "no-store"}
        if not api_key:
            return FileResponse(page, media_type="text/html", headers=no_cache)
        given = request.query_params.get("key")
        if given is not None:
            if not _same(given, api_key):
                return _refusal(401, "That API key is not this server's.")
            # Keep the key out of the address bar and the history from here on (other options stay).
            rest = urlencode([(k, v) for k, v in request.query_params.multi_items() if k != "key"])
            out = RedirectResponse("/dashboard" + (f"?{rest}" if rest else ""), status_code=303)
            out.set_cookie(COOKIE, given, httponly=True, samesite="strict", secure=request.url.scheme == "https")
            return out
        header = request.headers.get("authorization", "")
        if _same(request.cookies.get(COOKIE), api_key) or (header[:7].lower() == "bearer "
                                                            and _same(header[7:].strip(), api_key)):
            return FileResponse(page, media_type="text/html", headers=no_cache)
        if request.cookies.get(COOKIE):
            return _refusal(401, "The API key this browser kept is not this server's (was it restarted with a new key?).")
        return _refusal(401, "This server wants an API key.")
