"""The dashboard: static pages under /ui/ (their data comes from the API, live from
GET /events/stream), its login, and the session cookie the API accepts from it.

The pages themselves hold no data, so they are served to anyone; with an admin token set, the
API answers them only with the session cookie /ui/login sets. That cookie never holds the token:
it is `<issued_ms>.<HMAC(token, issued_ms)>`, HttpOnly and SameSite=Strict (Secure over TLS),
valid for SESSION_MS. Writes with the cookie also need the CSRF token (a second, script-readable
cookie, HMAC(token, session)) in an X-CSRF-Token header, and a same-origin Origin when the
browser sends one. These routes are not in the OpenAPI document: they are not the API.
"""

from __future__ import annotations

import hashlib
import hmac
import html
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from nulltickets.domain.clock import wall_ms as now_ms
from nulltickets.domain.tokens import same_token
from nulltickets.http.request import Request, parse_query
from nulltickets.http.response import CSS, HTML, JS, SVG, redirect, web
from nulltickets.http.routes import Auth, Route
from nulltickets.service import Recorded as Reply

if TYPE_CHECKING:
    from nulltickets.http.handlers import Context

SESSION_COOKIE = "nt_session"
CSRF_COOKIE = "nt_csrf"
CSRF_HEADER = "x-csrf-token"
SESSION_MS = 12 * 3600 * 1000

_TYPES = {".html": HTML, ".css": CSS, ".js": JS, ".svg": SVG}
_SECURITY = (
    ("cache-control", "no-cache"),
    ("x-content-type-options", "nosniff"),
    ("x-frame-options", "DENY"),
    ("referrer-policy", "same-origin"),
    (
        "content-security-policy",
        "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
        "connect-src 'self'; frame-ancestors 'none'; form-action 'self'",
    ),
)


# --- session cookie ------------------------------------------------------------------------------


def _mac(token: str, message: str) -> str:
    return hmac.new(token.encode(), message.encode(), hashlib.sha256).hexdigest()


def new_session(token: str, now: int) -> str:
    return f"{now}.{_mac(token, 'session:' + str(now))}"


def csrf_for(token: str, session: str) -> str:
    return _mac(token, "csrf:" + session)


def cookies(req: Request) -> dict[str, str]:
    found: dict[str, str] = {}
    for part in (req.header("cookie") or "").split(";"):
        name, sep, value = part.strip().partition("=")
        if sep and name not in found:
            found[name] = value
    return found


def _session_ok(token: str, session: str, now: int) -> bool:
    issued, sep, mac = session.partition(".")
    if not sep or not issued.isdigit():
        return False
    if not 0 <= now - int(issued) <= SESSION_MS:
        return False
    return same_token(mac, _mac(token, "session:" + issued))


def _same_origin(req: Request) -> bool:
    origin = req.header("origin")
    if origin is None:  # no Origin (an older browser): SameSite=Strict and the header remain
        return True
    host = req.header("host")
    return host is not None and urlsplit(origin).netloc == host


def session_admits(token: str, req: Request) -> bool:
    """Whether the request carries a live dashboard session (and, for writes, the CSRF
    token and a same-origin Origin): then it counts as carrying the admin token."""
    jar = cookies(req)
    session = jar.get(SESSION_COOKIE)
    if session is None or not _session_ok(token, session, now_ms()):
        return False
    if req.method in ("GET", "HEAD"):
        return True
    sent = req.header(CSRF_HEADER)
    return sent is not None and same_token(sent, csrf_for(token, session)) and _same_origin(req)


# --- pages ---------------------------------------------------------------------------------------


@cache
def _asset(name: str) -> bytes | None:
    root = resources.files("nulltickets.http").joinpath("static")
    item = root.joinpath(name)
    if "/" in name or name.startswith(".") or not item.is_file():
        return None
    return item.read_bytes()


def _page(status: int, body: bytes | str) -> Reply:
    return web(status, body, HTML, *_SECURITY)


async def root(ctx: Context, req: Request) -> Reply:
    return redirect("/ui/", 302)


async def page(ctx: Context, req: Request) -> Reply:
    """/ui/static/<file>: an asset; /ui/login: the login form; any other /ui/...: the page
    (one HTML shell; the script draws the page the path names)."""
    rest = req.segments[1:]
    if rest and rest[0] == "static":
        name = "/".join(rest[1:])
        body = _asset(name)
        if body is None:
            return _page(404, _message("Not found", f"No file {name!r} in the dashboard."))
        kind = _TYPES.get(name[name.rfind(".") :], "application/octet-stream")
        return web(200, body, kind, *_SECURITY)
    if rest and rest[0] == "login":
        return _page(200, _login_form(ctx, req, ""))
    known = ("", "tasks", "task", "failures", "store")
    if (rest[0] if rest else "") not in known:
        return _page(404, _message("Not found", "No such dashboard page."))
    body = _asset("index.html")
    assert body is not None
    return _page(200, body)


async def login(ctx: Context, req: Request) -> Reply:
    form = parse_query(req.body.decode("utf-8", "replace"))
    token = ctx.admin_token
    target = _next(form.get("next"))
    if token is None:  # nothing to log in to
        return redirect(target)
    if not same_token(form.get("token", ""), token):
        return _page(401, _login_form(ctx, req, "That token is not the server's admin token."))
    session = new_session(token, now_ms())
    secure = "; Secure" if _tls(req) else ""
    return redirect(
        target,
        303,
        ("set-cookie", f"{SESSION_COOKIE}={session}; Path=/; HttpOnly; SameSite=Strict{secure}"),
        (
            "set-cookie",
            f"{CSRF_COOKIE}={csrf_for(token, session)}; Path=/; SameSite=Strict{secure}",
        ),
        ("cache-control", "no-store"),
    )


async def logout(ctx: Context, req: Request) -> Reply:
    gone = "=; Path=/; Max-Age=0; SameSite=Strict"
    return redirect(
        "/ui/login",
        303,
        ("set-cookie", SESSION_COOKIE + gone + "; HttpOnly"),
        ("set-cookie", CSRF_COOKIE + gone),
    )


def _tls(req: Request) -> bool:
    return req.scheme == "https" or req.header("x-forwarded-proto") == "https"


def _next(target: str | None) -> str:
    """Only a dashboard path: never another site (an open redirect)."""
    if target and target.startswith("/ui/") and "//" not in target and "\\" not in target:
        return target
    return "/ui/"


def _message(title: str, text: str) -> str:
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)} · nulltickets</title>"
        '<link rel="stylesheet" href="/ui/static/style.css">'
        '<link rel="icon" href="/ui/static/favicon.svg" type="image/svg+xml"></head>'
        f'<body><main class="narrow"><h1>{html.escape(title)}</h1>'
        f'<p>{html.escape(text)}</p><p><a href="/ui/">Overview</a></p></main></body></html>'
    )


def _login_form(ctx: Context, req: Request, error: str) -> str:
    target = _next(
        req.query.get("next") or parse_query(req.body.decode("utf-8", "replace")).get("next")
    )
    note = (
        "This server has an admin token: enter it once; the dashboard then keeps a session "
        "cookie (not the token) for 12 hours."
        if ctx.admin_token is not None
        else "This server has no admin token: the dashboard is open."
    )
    alert = f'<p class="error" role="alert">{html.escape(error)}</p>' if error else ""
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        "<title>Log in · nulltickets</title>"
        '<link rel="stylesheet" href="/ui/static/style.css">'
        '<link rel="icon" href="/ui/static/favicon.svg" type="image/svg+xml"></head>'
        '<body><main class="narrow"><h1>nulltickets</h1>'
        f"<p>{html.escape(note)}</p>{alert}"
        '<form method="post" action="/ui/login" id="login">'
        f'<input type="hidden" name="next" value="{html.escape(target)}">'
        '<label>Admin token <input type="password" name="token" id="token" '
        'autocomplete="current-password" required autofocus></label>'
        '<button type="submit">Log in</button></form></main></body></html>'
    )


def _routes() -> tuple[Route, ...]:
    return (
        Route("GET", "/", root, "Redirect to the dashboard.", Auth.NONE),
        Route("GET", "/ui", page, "The dashboard's pages and files.", Auth.NONE, trailing=True),
        Route("POST", "/ui/login", login, "Log in to the dashboard.", Auth.NONE),
        Route("POST", "/ui/logout", logout, "Log out of the dashboard.", Auth.NONE),
    )


# Served by the same router as the API, but not part of it (so not in ROUTES nor OpenAPI).
UI_ROUTES = _routes()
