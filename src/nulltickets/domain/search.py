"""What a search is for: the user's text as a list of terms, whichever backend searches."""

from __future__ import annotations

import re

_SPLIT = re.compile(r"[ \t\r\n\x00]+")


def search_terms(text: str) -> list[str]:
    """The whitespace-separated terms of `text` (NUL counts as a space). Every term is a word
    to find, never an operator: each backend quotes them in its own query language (FTS5
    phrases in storage/sqlite/search.py). Empty when the text has no term."""
    return [t for t in _SPLIT.split(text) if t]
