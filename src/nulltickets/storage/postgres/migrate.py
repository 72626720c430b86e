"""Bring a PostgreSQL database to the current schema: numbered, forward-only migrations.

Each migration runs in its own transaction together with its row in nulltickets_schema, under
a transaction-level advisory lock, so that any number of servers starting at once on one
database apply each migration exactly once: the others wait for the lock, then find it
applied.
"""

from __future__ import annotations

import time
from importlib import resources
from typing import Any, LiteralString

import psycopg

from nulltickets.errors import StartupError
from nulltickets.storage.queries import load_backend_queries

Q = load_backend_queries("nulltickets.storage.postgres", "pyformat")

# The advisory lock key of the migrators: "NTKT", the mark SQLite files get as application_id.
MIGRATION_LOCK = 0x4E544B54


def migrations() -> list[tuple[int, str, LiteralString]]:
    """(number, file name, sql) of every migration, in order."""
    folder = resources.files("nulltickets.storage.postgres").joinpath("migrations")
    found: list[tuple[int, str, LiteralString]] = []
    for entry in folder.iterdir():
        if entry.name.endswith(".sql"):
            number = int(entry.name.split("_", 1)[0])
            sql: LiteralString = entry.read_text("utf-8")  # our own files, never user input
            found.append((number, entry.name, sql))
    found.sort()
    if [n for n, _, _ in found] != list(range(1, len(found) + 1)):
        raise StartupError("migrations must be numbered 1..N without gaps")
    return found


def migrate(conn: psycopg.Connection[Any], now_ms: int | None = None) -> int:
    """Apply every migration the database lacks; return the schema version it then has.

    `conn` must be in autocommit mode (each migration is its own transaction). `now_ms` is
    recorded as applied_at_ms (default: the wall clock). Raises StartupError when the database
    was migrated by a newer nulltickets.
    """
    if not conn.autocommit:
        raise ValueError("migrate() needs a connection in autocommit mode")
    row = conn.execute(Q["server_encoding"]).fetchone()
    encoding = row[0] if row is not None else "unknown"
    if isinstance(encoding, bytes):  # SQL_ASCII: psycopg gives text as bytes
        encoding = encoding.decode("ascii", "replace")
    if encoding != "UTF8":
        # Task text is Unicode: another encoding refuses some of it, and SQL_ASCII keeps bytes
        # nothing can read back as text.
        raise StartupError(
            f"the database has encoding {encoding}, and nulltickets needs UTF8: create it with "
            "CREATE DATABASE ... ENCODING 'UTF8' TEMPLATE template0"
        )
    now = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    known = migrations()
    for number, name, sql in known:
        with conn.transaction():
            conn.execute(Q["schema_lock"], {"lock_key": MIGRATION_LOCK})
            conn.execute(Q["schema_create"])
            applied = [row[0] for row in conn.execute(Q["schema_versions"])]
            if applied and applied[-1] > len(known):
                raise StartupError(
                    f"database schema version {applied[-1]} is newer than this nulltickets "
                    f"({len(known)})"
                )
            if number in applied:
                continue
            conn.execute(sql)  # no parameters: the simple protocol runs the whole script
            conn.execute(Q["schema_record"], {"version": number, "name": name, "now": now})
    return len(known)
