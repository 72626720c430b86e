"""Turning any user text into a safe FTS5 query."""

from __future__ import annotations

import re

_SPLIT = re.compile(r"[ \t\r\n\x00]+")


def fts_query(text: str) -> str | None:
    """Each whitespace-separated term becomes a quoted FTS5 phrase, joined by AND.

    So user text can never use FTS operators, prefixes or column filters: `NEAR(a b)`, `a*`,
    `-x`, `col:term` and stray quotes are all just words. Returns None when no term remains.
    """
    terms = [t for t in _SPLIT.split(text) if t]
    if not terms:
        return None
    return " ".join('"' + t.replace('"', '""') + '"' for t in terms)
