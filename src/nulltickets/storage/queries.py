"""Parse named SQL blocks out of a .sql file, and put together the queries of a backend.

A backend's queries come from two files: `storage/queries.sql`, the statements both backends
run word for word, and the backend's own `queries.sql`, those whose text differs (each name
there in both backends' files) and the few only one backend has. A name is defined in exactly
one of the two: a backend's file never overrides a shared statement, and `load_backend_queries`
refuses a name found in both. A statement that comes to differ moves out of the shared file
into both backends' files; one that comes to be the same moves into the shared file
(tests/unit/test_queries_shared.py fails on a copy in both backends' files).

A block starts with a line `-- name --`; following comment lines describe it; the statement
runs to the next block header. A block headed `-- fragment name --` is no statement but a
piece of several: a statement (or another fragment) writes `{name}` where the piece goes and
gets its text there, parameters and all. A fragment serves the file it is in only and is not
among the queries returned; a fragment that contains itself is refused. A `{name}` that names
no fragment of the file stays as written (transfer.sql's `{table}` and `{columns}`, which
psycopg's `sql.SQL.format` fills), and braces inside string literals (JSON, arrays) are text.

Parameters are written `:name` in every file; for psycopg (paramstyle "pyformat") they become
`%(name)s` and a literal `%` becomes `%%`, outside string literals, quoted identifiers and
comments (`::type` casts stay as they are).

The comments are for readers of the file: the statement a driver gets has none, nor any
indentation or empty line. apsw finds a prepared statement by hashing and comparing its whole
text on every execute, and psycopg sends the whole text each time, so what only a reader needs
stays in the file (the claim cycle's statements were about half comments and indentation).
"""

from __future__ import annotations

import re
from importlib import resources
from typing import Literal, LiteralString

Paramstyle = Literal["named", "pyformat"]

_HEADER = re.compile(r"^-- (fragment )?([a-z0-9_]+) --\s*$", re.MULTILINE)

# Whatever a fragment's place can never be inside, then the place: {name}.
_PLACE = re.compile(
    r"""'(?:[^']|'')*'"""  # string literal
    r'''|"(?:[^"]|"")*"'''  # quoted identifier
    r"|\$\$.*?\$\$"  # dollar-quoted body
    r"|\{([a-z0-9_]+)\}",
    re.DOTALL,
)

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


# What may hold `--` without starting a comment (kept, group 1), then a comment.
_COMMENT = re.compile(
    r"""('(?:[^']|'')*'"""  # string literal
    r'''|"(?:[^"]|"")*"'''  # quoted identifier
    r"|\$\$.*?\$\$)"  # dollar-quoted body
    r"|--[^\n]*",  # comment
    re.DOTALL,
)
# Single quotes that neither open nor close a literal: doubled ones, those in quoted identifiers.
_NOT_QUOTES = re.compile(r"''|\"(?:[^\"]|\"\")*\"")


def _compact(sql: str) -> str:
    """`sql` without comments, indentation, trailing blanks or empty lines. Line breaks stay
    (no two tokens are joined), and lines inside a literal that spans lines stay as written."""
    kept = _COMMENT.sub(lambda m: m.group(1) or "", sql)
    lines: list[str] = []
    inside = False  # within a string literal that spans lines
    for line in kept.split("\n"):
        if inside:
            lines.append(line)
        elif stripped := line.strip():
            lines.append(stripped)
        if _NOT_QUOTES.sub("", line).count("'") % 2:
            inside = not inside
    return "\n".join(lines)


def _pyformat(sql: str) -> str:
    def replace(match: re.Match[str]) -> str:
        token, name = match.group(0), match.group(1)
        if name is not None:
            return f"%({name})s"
        return token.replace("%", "%%")

    return _TOKEN.sub(replace, sql)


def _assemble(
    name: str, blocks: dict[str, str], fragments: set[str], using: tuple[str, ...]
) -> str:
    """Block `name` with each `{fragment}` place filled in, fragments within fragments too."""
    if name in using:
        raise ValueError(f"fragment {name!r} contains itself: {' -> '.join((*using, name))}")

    def fill(match: re.Match[str]) -> str:
        piece = match.group(1)
        if piece is None or piece not in fragments:
            return match.group(0)
        return _assemble(piece, blocks, fragments, (*using, name))

    return _PLACE.sub(fill, blocks[name])


def parse_queries(text: str, paramstyle: Paramstyle = "named") -> dict[str, LiteralString]:
    parts = _HEADER.split(text)
    blocks: dict[str, str] = {}
    fragments: set[str] = set()
    for fragment, name, body in zip(parts[1::3], parts[2::3], parts[3::3], strict=True):
        if name in blocks:
            raise ValueError(f"query {name!r} is defined twice")
        blocks[name] = _compact(body)
        if fragment:
            fragments.add(name)
    queries: dict[str, LiteralString] = {}
    for name in blocks:
        if name in fragments:
            continue
        sql = _assemble(name, blocks, fragments, ())
        if paramstyle == "pyformat":
            sql = _pyformat(sql)
        queries[name] = sql  # our own files' text, never built from input
    return queries


def load_queries(
    package: str, filename: str, paramstyle: Paramstyle = "named"
) -> dict[str, LiteralString]:
    text = resources.files(package).joinpath(filename).read_text("utf-8")
    return parse_queries(text, paramstyle)


SHARED = "nulltickets.storage"  # the package holding the queries.sql both backends share


def load_backend_queries(
    package: str, paramstyle: Paramstyle = "named"
) -> dict[str, LiteralString]:
    """The queries of the backend in `package`: the shared file's and its own queries.sql's.
    Raises ValueError if a name is in both (see the module's docstring)."""
    shared = load_queries(SHARED, "queries.sql", paramstyle)
    own = load_queries(package, "queries.sql", paramstyle)
    if both := sorted(shared.keys() & own.keys()):
        raise ValueError(f"{package} redefines shared queries: {', '.join(both)}")
    return shared | own


def parameter_names(sql: str) -> tuple[str, ...]:
    """The `:name` parameters of `sql` in the order of their first appearance, each once:
    the order in which SQLite numbers them, so their values can be bound by position."""
    names: dict[str, None] = {}
    for match in _TOKEN.finditer(sql):
        name = match.group(1)
        if name is not None:
            names.setdefault(name)
    return tuple(names)
