"""Which database `--db` names: a path (or a `file:` URI) is SQLite, a `postgresql://` or
`postgres://` URL is PostgreSQL. The PostgreSQL backend and its driver are imported only
when asked for, so a SQLite server never loads them and an install without the extra says
what to install instead of failing at import.

A backend provides a class implementing storage.ports.Database in its `database` module,
constructed as `Class(target, durability=..., readers=...)`:
`storage.sqlite.database.SqliteDatabase` and `storage.postgres.database.PostgresDatabase`
(whose module imports psycopg when it is imported, so that a missing driver is reported
here).
"""

from __future__ import annotations

import importlib
from typing import Any

from nulltickets.errors import StartupError
from nulltickets.storage.dsn import display_name as display_name
from nulltickets.storage.dsn import secrets_of as secrets_of
from nulltickets.storage.ports import Capabilities, Database

POSTGRES_SCHEMES = ("postgresql://", "postgres://")
POSTGRES_EXTRA = "pip install 'nulltickets[postgres]'"
# The modules a PostgreSQL database needs: the backend's package (storage/postgres) and the
# driver it stands on.
_DRIVERS = ("psycopg", "psycopg_pool")


def is_postgres(target: str) -> bool:
    return target.startswith(POSTGRES_SCHEMES)


def engine_description(target: str) -> str:
    """The engine the start-up line names: for SQLite its version and our compile options."""
    if is_postgres(target):
        return "PostgreSQL"
    from nulltickets.storage.sqlite import connection

    return f"SQLite {connection.sqlite_version()} ({' '.join(connection.sqlite_options())})"


def make_database(target: str, *, durability: str = "full", readers: int = 4) -> Database:
    """The database `target` names, not yet opened."""
    if is_postgres(target):
        return _postgres(target, durability=durability, readers=readers)
    from nulltickets.storage.sqlite.database import SqliteDatabase

    # A path, or a `file:` URI that SQLite opens as such (storage/sqlite/connection.py).
    return SqliteDatabase(target, durability=durability, readers=readers)


def open_database(target: str, *, durability: str = "full", readers: int = 4) -> Database:
    """The database `target` names, checked, migrated and open. Errors are StartupError (or
    a Storage* error) with a one-line message."""
    database = make_database(target, durability=durability, readers=readers)
    database.open()
    return database


def check_database(target: str, *, durability: str = "full") -> Capabilities:
    """Open, check and migrate the database, then close it again: what the launcher runs
    before serving, so that a bad path, a read-only file, an old SQLite, an unreachable
    server or a missing driver is a clear start-up error. Nothing stays open (connections
    must not cross the fork into the worker). Returns what the backend can do."""
    database = open_database(target, durability=durability, readers=1)
    try:
        return database.capabilities
    finally:
        database.close()


def inspect_postgres(url: str) -> Any:
    """`nulltickets doctor` on the PostgreSQL database at `url`: a PostgresDoctorReport
    (storage/postgres/maintenance.py)."""
    return _postgres_module("maintenance").inspect(url)


def _postgres(url: str, *, durability: str, readers: int) -> Database:
    module = _postgres_module("database")
    database: Database = module.PostgresDatabase(url, durability=durability, readers=readers)
    return database


def _postgres_module(name: str) -> Any:
    try:
        return importlib.import_module(f"nulltickets.storage.postgres.{name}")
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing.split(".")[0] in _DRIVERS:
            raise StartupError(
                f"a PostgreSQL database needs the psycopg driver: {POSTGRES_EXTRA}"
            ) from None
        if missing.startswith("nulltickets.storage.postgres"):
            raise StartupError("this build of nulltickets has no PostgreSQL backend") from None
        raise
