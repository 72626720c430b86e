"""A request as handlers see it: method, path segments, decoded query, headers and body."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote_plus

from nulltickets.errors import Unauthorized

if TYPE_CHECKING:
    from nulltickets.http.access import Principal

# granian hands the application the path already percent-decoded once, so `%2F` has become a
# separator before the path is split. What a client means to keep inside one segment it encodes
# twice: `/` as `%252F`, `%` as `%2525`, which arrive here as `%2F` and `%25`.
_ESCAPED = re.compile("%(2[fF]|25)")


def _unescape(match: re.Match[str]) -> str:
    return "%" if match.group(1) == "25" else "/"


def split_path(path: str) -> list[str]:
    """The path's non-empty segments, split first, then `%2F` -> `/` and `%25` -> `%` inside
    each: a namespace `team/alpha` (sent as `team%252Falpha`) stays one segment."""
    segments = [s for s in path.split("/") if s]
    if "%" in path:
        segments = [_ESCAPED.sub(_unescape, s) for s in segments]
    return segments


def parse_query(query_string: str) -> dict[str, str]:
    """`name=value` pairs only, first occurrence wins, values percent-decoded (`+` is a space)."""
    params: dict[str, str] = {}
    if not query_string:
        return params
    for pair in query_string.split("&"):
        name, sep, value = pair.partition("=")
        if sep and name not in params:
            params[name] = unquote_plus(value, errors="replace")
    return params


@dataclass(slots=True)
class Request:
    method: str
    path: str
    segments: list[str]
    query_string: str
    headers: Any  # granian's RSGIHeaders (case-insensitive .get)
    body: bytes = b""
    params: dict[str, str] = field(default_factory=dict)
    proto: Any = None
    scheme: str = "http"  # "https" when the request came over TLS
    client: str = ""  # the peer's "address:port"
    # Who the request speaks for, once the gate checked it (None: ungated, or no --token).
    principal: Principal | None = None
    _query: dict[str, str] | None = None

    @property
    def sender(self) -> str:
        """The peer's address, without its port."""
        return self.client.rpartition(":")[0] or self.client

    def disconnected(self) -> Any:
        """An awaitable that completes when the client goes away (None outside a server)."""
        return self.proto.client_disconnect() if self.proto is not None else None

    @property
    def query(self) -> dict[str, str]:
        if self._query is None:
            self._query = parse_query(self.query_string)
        return self._query

    def header(self, name: str) -> str | None:
        value: str | None = self.headers.get(name)
        return value

    def bearer(self) -> str | None:
        """The token of `Authorization: Bearer <token>`, the scheme word in any case (RFC 9110
        §11.1), one space, the token the rest of the value; else None."""
        value = self.header("authorization")
        if value is None or value[6:7] != " " or value[:6].lower() != "bearer":
            return None
        return value[7:]

    def require_bearer(self) -> str:
        token = self.bearer()
        if token is None:
            raise Unauthorized("missing Authorization: Bearer token")
        return token

    def body_hash(self) -> bytes:
        return hashlib.sha256(self.body).digest()
