"""What a handler answers: a status and the body as sent (JSON unless said otherwise); replies
that are not JSON: a body with its own headers (HTML, CSS, JS, the Prometheus text format, a
redirect), and the mark of a reply a handler has already streamed itself (SSE).

API errors never come this way: whatever a handler raises still becomes the JSON envelope.
"""

from __future__ import annotations

from dataclasses import dataclass

HTML = "text/html; charset=utf-8"
CSS = "text/css; charset=utf-8"
JS = "text/javascript; charset=utf-8"
SVG = "image/svg+xml"
PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"
EVENT_STREAM = "text/event-stream"


@dataclass(frozen=True, slots=True)
class Reply:
    """A status and the encoded JSON body, as sent."""

    status: int
    body: bytes


@dataclass(frozen=True, slots=True)
class WebReply(Reply):
    """A reply with the headers it is sent with (content-type among them)."""

    headers: tuple[tuple[str, str], ...] = ()


def web(status: int, body: bytes | str, content_type: str, *extra: tuple[str, str]) -> WebReply:
    data = body.encode() if isinstance(body, str) else body
    return WebReply(status, data, (("content-type", content_type), *extra))


def redirect(location: str, status: int = 303, *extra: tuple[str, str]) -> WebReply:
    return WebReply(status, b"", (("location", location), *extra))


# A handler that answered through proto.response_stream itself returns this: nothing more to send.
STREAMED = WebReply(0, b"")
