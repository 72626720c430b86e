"""Parse named SQL blocks out of a .sql file.

A block starts with a line `-- name --`; following comment lines describe it; the statement
runs to the next block header. Parameters are written `:name` in every file; for psycopg
(paramstyle "pyformat") they become `%(name)s` and a literal `%` becomes `%%`, outside string
literals, quoted identifiers and comments (`::type` casts stay as they are).
"""

from __future__ import annotations

import re
from importlib import resources
from typing import Literal, LiteralString, cast

Paramstyle = Literal["named", "pyformat"]

_HEADER = re.compile(r"^-- ([a-z0-9_]+) --\s*$", re.MULTILINE)

# Whatever a parameter can never be inside, then a parameter, then a bare %.
_TOKEN = re.compile(
    r"""'(?:[^']|'')*'"""  # string literal
    r'''|"(?:[^"]|"")*"'''  # quoted identifier
    r"|--[^\n]*"  # comment
    r"|\$\$.*?\$\$"  # dollar-quoted body
    r"|::"  # cast
    r"|:([A-Za-z_][A-Za-z0-9_]*)"  # parameter
    r"|%",
    re.DOTALL,
)


def _pyformat(sql: str) -> str:
    def replace(match: re.Match[str]) -> str:
        token, name = match.group(0), match.group(1)
        if name is not None:
            return f"%({name})s"
        return token.replace("%", "%%")

    return _TOKEN.sub(replace, sql)


def parse_queries(text: str, paramstyle: Paramstyle = "named") -> dict[str, LiteralString]:
    parts = _HEADER.split(text)
    queries: dict[str, LiteralString] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise ValueError(f"query {name!r} is defined twice")
        sql = body.strip()
        if paramstyle == "pyformat":
            sql = _pyformat(sql)
        queries[name] = cast(LiteralString, sql)
    return queries


def load_queries(
    package: str, filename: str, paramstyle: Paramstyle = "named"
) -> dict[str, LiteralString]:
    text = resources.files(package).joinpath(filename).read_text("utf-8")
    return parse_queries(text, paramstyle)
