"""What web pages may do: the check every request passes before any other work.

A browser lets any page send simple requests to any address, loopback included (a `no-cors`
POST with a text body reaches the server; only the answer stays hidden), and a page whose
name was re-pointed at 127.0.0.1 (DNS rebinding) can even read the answers. So:

- a request whose `Origin` is present and is neither this server's own origin (its scheme and
  the `Host` it was sent to) nor one of `--allowed-origins` is refused; `null` (sandboxed
  frames, file:// pages) is foreign;
- a request a browser marks `Sec-Fetch-Site: cross-site` is refused, except from an allowed
  origin and except a plain navigation to the dashboard's pages (a link someone follows: the
  pages hold no data, and what they then ask for is same-origin);
- on a server that trusts requests without a key (no token), `Host` must be a name the server
  answers to: localhost and `*.localhost`, the loopback addresses, the bind address and
  `--allowed-hosts`.

Clients that send neither `Origin` nor `Sec-Fetch-Site` (curl, the agents, nullboiler,
nullhub) pay two or three header lookups and a set lookup; everything else is precomputed.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from nulltickets.config import Settings
from nulltickets.errors import ForeignOrigin, UnknownHost

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
# How much of a refused header value a message repeats.
ECHO_CHARS = 100


def host_name(host: str) -> str:
    """The name part of a Host value, lowercase: `[::1]:7700` -> `[::1]`, `A.b.:80` -> `a.b`."""
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[: end + 1] if end > 0 else host
    return host.partition(":")[0].rstrip(".")


def loopback_address(name: str) -> bool:
    """Whether a Host name is a loopback address literal (any of 127/8, ::1)."""
    try:
        return ipaddress.ip_address(name[1:-1] if name.startswith("[") else name).is_loopback
    except ValueError:
        return False


def _echo(value: str) -> str:
    return repr(value if len(value) <= ECHO_CHARS else value[:ECHO_CHARS] + "...")


class OriginGuard:
    """Built once per server from its settings; `check` runs on every request."""

    def __init__(self, settings: Settings) -> None:
        self.allowed_origins = frozenset(settings.allowed_origins)
        self.names: frozenset[str] | None = None  # None: every Host is admitted
        self._host_values: frozenset[str] = frozenset()
        if not settings.token:
            names = {*LOOPBACK_NAMES, *settings.allowed_hosts, host_name(_bracketed(settings.host))}
            self.names = frozenset(names)
            # The Host values clients send most (name and name:port), matched without parsing.
            self._host_values = frozenset({*names, *(f"{n}:{settings.port}" for n in names)})

    def check(self, headers: Any, scheme: str, method: str, path: str) -> None:
        """Raise Forbidden (403) for a request a foreign page or name sent; else nothing."""
        host: str | None = headers.get("host")
        if (
            self.names is not None
            and host is not None
            and host not in self._host_values
            and not self._answers_to(host)
        ):
            raise UnknownHost(
                f"this server does not answer to the name in Host {_echo(host)} (a page "
                "whose name was pointed at this address, as DNS rebinding does, gets nothing); "
                "to allow the name, start the server with --allowed-hosts NAME"
            )
        origin: str | None = headers.get("origin")
        if origin is not None:
            if origin in self.allowed_origins:
                return
            if not self._same_origin(origin, scheme, host, headers):
                raise ForeignOrigin(
                    f"requests from pages of another origin are refused: Origin {_echo(origin)} "
                    "is not this server's own; to allow that origin, start the server with "
                    "--allowed-origins ORIGIN"
                )
        if headers.get("sec-fetch-site") == "cross-site" and not _dashboard_visit(
            headers, method, path
        ):
            raise ForeignOrigin(
                "cross-site requests (Sec-Fetch-Site: cross-site) are refused: a page of "
                "another site sent this; to allow that site, start the server with "
                "--allowed-origins ORIGIN"
            )

    def _answers_to(self, host: str) -> bool:
        assert self.names is not None
        name = host_name(host)
        return (
            name in self.names
            or name.endswith(".localhost")  # browsers resolve these to loopback themselves
            or loopback_address(name)
        )

    def _same_origin(self, origin: str, scheme: str, host: str | None, headers: Any) -> bool:
        if host is None:
            return False
        origin = origin.lower()
        host = host.lower()
        if origin == f"{scheme}://{host}":
            return True
        # Behind a proxy that ends TLS and keeps Host, the page's origin is https.
        return headers.get("x-forwarded-proto") == "https" and origin == f"https://{host}"


def _dashboard_visit(headers: Any, method: str, path: str) -> bool:
    """A person following a link to a dashboard page: a top-level GET navigation to / or
    /ui/..., whose pages hold no data (they read it with same-origin requests)."""
    return (
        method in ("GET", "HEAD")
        and (path == "/" or path == "/ui" or path.startswith("/ui/"))
        and headers.get("sec-fetch-mode") == "navigate"
        and headers.get("sec-fetch-dest") == "document"
    )


def _bracketed(host: str) -> str:
    """An IPv6 bind address as Host spells it (`::1` -> `[::1]`)."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host
    return f"[{address}]" if address.version == 6 else str(address)
