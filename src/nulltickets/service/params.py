"""Query parameters as a verb takes them: each parser turns the text a caller sent (None when
it sent none) into the value the implementation gets, or a TrackerError saying what is wrong.

They are the API's, not HTTP's: the MCP tools and the CLI hand their arguments to the same
parsers, so a limit or a cursor means the same on every surface.
"""

from __future__ import annotations

from collections.abc import Callable

from nulltickets.errors import InvalidCursor, InvalidLimit, InvalidRequest

MAX_LIMIT = 1000

Parse = Callable[[str | None], object]


def _int64(text: str) -> int:
    value = int(text)
    if not -(2**63) <= value < 2**63:
        raise ValueError(text)
    return value


def text(raw: str | None) -> str | None:
    return raw


def text_or_none(raw: str | None) -> str | None:
    """Empty means absent."""
    return raw or None


def limit(default: int) -> Callable[[str | None], int]:
    """A page size, 1..MAX_LIMIT; anything unparsable means `default`."""

    def parse(raw: str | None) -> int:
        try:
            value = int(raw) if raw is not None else default
        except ValueError:
            value = default
        if not 1 <= value <= MAX_LIMIT:
            raise InvalidLimit(f"limit must be between 1 and {MAX_LIMIT}")
        return value

    return parse


def search_limit(raw: str | None) -> int:
    """Store search: non-numeric or negative -> 10; 0 or over 1000 -> invalid_limit."""
    try:
        value = int(raw) if raw is not None else 10
    except ValueError:
        return 10
    if value < 0:
        return 10
    if not 1 <= value <= MAX_LIMIT:
        raise InvalidLimit(f"limit must be between 1 and {MAX_LIMIT}")
    return value


def integer(default: int) -> Callable[[str | None], int]:
    """An integer; anything unparsable means `default`."""

    def parse(raw: str | None) -> int:
        try:
            value = int(raw) if raw is not None else default
        except ValueError:
            return default
        return max(-(2**62), min(value, 2**62))

    return parse


def bounded(name: str, low: int, default: int, high: int) -> Callable[[str | None], int]:
    """An integer in low..high; unparsable means `default`, out of range is refused."""
    read = integer(default)

    def parse(raw: str | None) -> int:
        value = read(raw)
        if not low <= value <= high:
            raise InvalidRequest(f"{name} must be between {low} and {high}")
        return value

    return parse


def composite_cursor(raw: str | None) -> tuple[int, str] | None:
    """A keyset cursor `<at_ms>:<id>`."""
    if raw is None:
        return None
    left, sep, right = raw.partition(":")
    try:
        if not sep or not left or not right:
            raise ValueError
        return _int64(left), right
    except ValueError:
        raise InvalidCursor("cursor must look like <created_at_ms>:<id>") from None


def id_cursor(what: str = "an event id") -> Callable[[str | None], int]:
    """A cursor that is an integer id (0: from the start)."""

    def parse(raw: str | None) -> int:
        if raw is None:
            return 0
        try:
            return _int64(raw)
        except ValueError:
            raise InvalidCursor(f"cursor must be {what}") from None

    return parse


def optional_id_cursor(what: str) -> Callable[[str | None], int | None]:
    """An integer cursor, None when absent."""
    read = id_cursor(what)
    return lambda raw: None if raw is None else read(raw)


def newest_first(raw: str | None) -> bool:
    """order=asc (the default) or desc."""
    if raw is None or raw == "asc":
        return False
    if raw == "desc":
        return True
    raise InvalidRequest("order must be asc (oldest attempt first) or desc (newest first)")
