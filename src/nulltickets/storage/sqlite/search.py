"""The user's search terms as a safe FTS5 query."""

from __future__ import annotations

from collections.abc import Sequence


def fts_query(terms: Sequence[str]) -> str:
    """Each term becomes a quoted FTS5 phrase, joined by AND.

    So user text can never use FTS operators, prefixes or column filters: `NEAR(a b)`, `a*`,
    `-x`, `col:term` and stray quotes are all just words.
    """
    return " ".join('"' + t.replace('"', '""') + '"' for t in terms)
