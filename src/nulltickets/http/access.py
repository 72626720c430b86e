"""Who a request speaks for, and what that may do: the `--token` (the root key, admin access),
a key made with POST /keys (read, agent or admin access), or a dashboard session of either.

On a server with a token, every gated route (Guard.KEY) needs one of them; the route
says which access it needs (Route.needs: reads need `read`, the writes agents make `agent`,
everything else `admin`), and an `agent` key claims only for its roles. A wrong token or key
is 401 and slows its sender down (slowdown.py); a known key without the access is 403. On a
server without a token nothing is checked here: every request is admitted, as before keys
(keys need a token: POST /keys says so). Writes under a lease take the lease token, never a
key (reading a run's events takes either).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from nulltickets.domain.model import Access, KeyInfo, allows
from nulltickets.domain.tokens import same_token
from nulltickets.errors import Forbidden, Unauthorized

if TYPE_CHECKING:
    from nulltickets.http.context import Context
    from nulltickets.http.request import Request
    from nulltickets.http.routes import Route


@dataclass(frozen=True, slots=True)
class Principal:
    """What a request may do: its access, and for an `agent` key the roles it claims for
    (None: any role). `key_id` is the key's id; None for the `--token`."""

    access: Access
    roles: frozenset[str] | None = None
    key_id: str | None = None


ROOT = Principal(Access.ADMIN)


def of_key(info: KeyInfo) -> Principal:
    roles = frozenset(info.roles) if info.access is Access.AGENT else None
    return Principal(info.access, roles, info.id)


async def principal_of(ctx: Context, presented: str) -> Principal | None:
    """The principal a presented token or key names, or None if it names none (the server
    has a token)."""
    token = ctx.admin_token
    if token is not None and same_token(presented, token):
        return ROOT
    info = await ctx.service.authenticate(presented)
    return None if info is None else of_key(info)


async def from_bearer(ctx: Context, req: Request) -> Principal:
    """The principal of the request's bearer; a wrong one is 401, after the slow-down."""
    presented = req.bearer()
    principal = None if presented is None else await principal_of(ctx, presented)
    if principal is None:
        await refused(ctx, req)
        raise Unauthorized("missing or invalid admin token or key")
    return principal


async def refused(ctx: Context, req: Request) -> None:
    """A wrong token or key was presented: wait as long as its sender has earned."""
    await ctx.slowdown.refused(req.sender)


def check_route(principal: Principal, route: Route) -> None:
    needed = route.needs
    if not allows(principal.access, needed):
        raise Forbidden(
            f"{_a(principal.access)} key may not call {route.method} {route.pattern} "
            f"(it needs {needed} access)"
        )


def check_role(principal: Principal | None, role: str) -> None:
    """An `agent` key claims only for its roles."""
    if principal is None or principal.roles is None or role in principal.roles:
        return
    raise Forbidden(f"this key claims only for the roles {', '.join(sorted(principal.roles))}")


def _a(access: Access) -> str:
    return ("an " if access[0] in "aeiou" else "a ") + access
