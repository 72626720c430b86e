"""The dashboard: static pages under /ui/ (their data comes from the API, live from
GET /events/stream), its login, and the session cookie the API accepts from it.

The pages themselves hold no data, so they are served to anyone; with an admin token set, the
API answers them only with the session cookie /ui/login sets, for the admin token or any key.
That cookie never holds the token nor the key: it is `<issued_ms>.<who>.<HMAC(token, ...)>`,
where `who` is `root` (the admin token) or the key's id, HttpOnly and SameSite=Strict (Secure
over TLS), valid for SESSION_MS. A session has its key's access (a revoked key's sessions end
with it), and the page is told that access (`data-access` on its body) to show no buttons a
`read` or `agent` session could not use; the API refuses those writes anyway. Writes with the
cookie also need the CSRF token (a second, script-readable cookie, HMAC(token, session)) in an
X-CSRF-Token header, and a same-origin Origin when the browser sends one. These routes are not
in the OpenAPI document: they are not the API.
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
from nulltickets.errors import Unauthorized
from nulltickets.http import access
from nulltickets.http.access import Principal
from nulltickets.http.request import Request, parse_query
from nulltickets.http.response import CSS, HTML, JS, SVG, Reply, redirect, web
from nulltickets.http.routes import Route
from nulltickets.service.verbs import Guard

if TYPE_CHECKING:
    from nulltickets.http.context import Context

SESSION_COOKIE = "nt_session"
CSRF_COOKIE = "nt_csrf"
CSRF_HEADER = "x-csrf-token"
SESSION_MS = 12 * 3600 * 1000
ROOT_SESSION = "root"  # a session of the admin token (any other `who` is a key's id)

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


def new_session(token: str, now: int, who: str = ROOT_SESSION) -> str:
    return f"{now}.{who}.{_mac(token, f'session:{now}:{who}')}"


def csrf_for(token: str, session: str) -> str:
    return _mac(token, "csrf:" + session)


def cookies(req: Request) -> dict[str, str]:
    found: dict[str, str] = {}
    for part in (req.header("cookie") or "").split(";"):
        name, sep, value = part.strip().partition("=")
        if sep and name not in found:
            found[name] = value
    return found


def _session_who(token: str, session: str, now: int) -> str | None:
    """Whose live session this is (`root` or a key's id), or None if it is not one."""
    parts = session.split(".")
    if len(parts) != 3:
        return None
    issued, who, mac = parts
    if not issued.isdigit() or not who or not 0 <= now - int(issued) <= SESSION_MS:
        return None
    if not same_token(mac, _mac(token, f"session:{issued}:{who}")):
        return None
    return who


def _same_origin(req: Request) -> bool:
    origin = req.header("origin")
    if origin is None:  # no Origin (an older browser): SameSite=Strict and the header remain
        return True
    host = req.header("host")
    return host is not None and urlsplit(origin).netloc == host


async def _session(ctx: Context, req: Request) -> Principal | None:
    """The principal of the request's live dashboard session, if it has one."""
    token = ctx.admin_token
    session = cookies(req).get(SESSION_COOKIE)
    if token is None or session is None:
        return None
    who = _session_who(token, session, now_ms())
    if who is None:
        return None
    if who == ROOT_SESSION:
        return access.ROOT
    info = await ctx.service.key_by_id(who)
    return None if info is None else access.of_key(info)


async def session_principal(ctx: Context, req: Request) -> Principal:
    """Who a request without a bearer speaks for: its live dashboard session (for writes,
    with the CSRF token and a same-origin Origin). Anything else is 401."""
    principal = await _session(ctx, req)
    if principal is None:
        raise Unauthorized("missing or invalid admin token")
    if req.method in ("GET", "HEAD"):
        return principal
    assert ctx.admin_token is not None
    session = cookies(req)[SESSION_COOKIE]
    sent = req.header(CSRF_HEADER)
    if sent is None or not same_token(sent, csrf_for(ctx.admin_token, session)):
        raise Unauthorized("a write with the dashboard's session needs its X-CSRF-Token")
    if not _same_origin(req):
        raise Unauthorized("a write with the dashboard's session must come from its own origin")
    return principal


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
    return _page(200, await _for_session(ctx, req, body))


async def _for_session(ctx: Context, req: Request, page: bytes) -> bytes:
    """The page with what its script needs to know of the session on its body: whether the
    server has a token (a session to log out of) and the session's access (which buttons)."""
    if ctx.admin_token is None:
        login, held = "off", "admin"
    else:
        principal = await _session(ctx, req)
        login, held = "on", "" if principal is None else str(principal.access)
    body = f'<body data-login="{login}" data-access="{held}">'.encode()
    return page.replace(b"<body>", body, 1)


async def login(ctx: Context, req: Request) -> Reply:
    form = parse_query(req.body.decode("utf-8", "replace"))
    token = ctx.admin_token
    target = _next(form.get("next"))
    if token is None:  # nothing to log in to
        return redirect(target)
    principal = await access.principal_of(ctx, form.get("token", ""))
    if principal is None:
        await access.refused(ctx, req)
        error = "That is not the server's admin token nor one of its keys."
        return _page(401, _login_form(ctx, req, error))
    who = ROOT_SESSION if principal.key_id is None else principal.key_id
    session = new_session(token, now_ms(), who)
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
        "This server has an admin token: enter it, or a key made for you, once; the dashboard "
        "then keeps a session cookie (not the token) for 12 hours. A read or agent key sees "
        "everything and changes nothing."
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
        '<label>Admin token or key <input type="password" name="token" id="token" '
        'autocomplete="current-password" required autofocus></label>'
        '<button type="submit">Log in</button></form></main></body></html>'
    )


def _routes() -> tuple[Route, ...]:
    return (
        Route("GET", "/", root, "Redirect to the dashboard.", Guard.NONE),
        Route("GET", "/ui", page, "The dashboard's pages and files.", Guard.NONE, trailing=True),
        Route("POST", "/ui/login", login, "Log in to the dashboard.", Guard.NONE),
        Route("POST", "/ui/logout", logout, "Log out of the dashboard.", Guard.NONE),
    )


# Served by the same router as the API, but not part of it (so not in ROUTES nor OpenAPI).
UI_ROUTES = _routes()
