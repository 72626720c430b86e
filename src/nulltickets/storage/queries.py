"""Parse named SQL blocks out of a .sql file.

A block starts with a line `-- name --`; following comment lines describe it; the statement
runs to the next block header.
"""

from __future__ import annotations

import re
from importlib import resources
from typing import LiteralString, cast

_HEADER = re.compile(r"^-- ([a-z0-9_]+) --\s*$", re.MULTILINE)


def parse_queries(text: str) -> dict[str, LiteralString]:
    parts = _HEADER.split(text)
    queries: dict[str, LiteralString] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise ValueError(f"query {name!r} is defined twice")
        queries[name] = cast(LiteralString, body.strip())
    return queries


def load_queries(package: str, filename: str) -> dict[str, LiteralString]:
    return parse_queries(resources.files(package).joinpath(filename).read_text("utf-8"))
