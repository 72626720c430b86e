"""Which database `--db` names: a path (or a `file:` URI) is SQLite, a `postgresql://` or
`postgres://` URL is PostgreSQL. The PostgreSQL backend and its driver are imported only
when asked for, so a SQLite server never loads them and an install without the extra says
what to install instead of failing at import.
"""

from __future__ import annotations

import importlib
from urllib.parse import urlsplit, urlunsplit

from nulltickets.errors import StartupError
from nulltickets.storage.ports import Database

POSTGRES_SCHEMES = ("postgresql://", "postgres://")
POSTGRES_EXTRA = "pip install 'nulltickets[postgres]'"
# The modules a PostgreSQL database needs: the backend's package (storage/postgres) and the
# driver it stands on.
_DRIVERS = ("psycopg", "psycopg_pool")


def is_postgres(target: str) -> bool:
    return target.startswith(POSTGRES_SCHEMES)


def sqlite_path(target: str) -> str:
    """The file a SQLite target names: a path as it is, `file:PATH` or `file://PATH`."""
    if target.startswith("file://"):
        return target[len("file://") :]
    if target.startswith("file:"):
        return target[len("file:") :]
    return target


def display_name(target: str) -> str:
    """The target as logs and the start-up line may show it: without a URL's password."""
    if not is_postgres(target):
        return sqlite_path(target)
    parts = urlsplit(target)
    if parts.password is None:
        return target
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit((parts.scheme, user + host, parts.path, parts.query, parts.fragment))


def make_database(target: str, *, durability: str = "full", readers: int = 4) -> Database:
    """The database `target` names, not yet opened."""
    if is_postgres(target):
        return _postgres(target, durability=durability, readers=readers)
    from nulltickets.storage.sqlite.database import SqliteDatabase

    return SqliteDatabase(sqlite_path(target), durability=durability, readers=readers)


def open_database(target: str, *, durability: str = "full", readers: int = 4) -> Database:
    """The database `target` names, checked, migrated and open. Errors are StartupError (or
    a Storage* error) with a one-line message."""
    database = make_database(target, durability=durability, readers=readers)
    database.open()
    return database


def _postgres(url: str, *, durability: str, readers: int) -> Database:
    try:
        module = importlib.import_module("nulltickets.storage.postgres")
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing.split(".")[0] in _DRIVERS:
            raise StartupError(
                f"a PostgreSQL database needs the psycopg driver: {POSTGRES_EXTRA}"
            ) from None
        if missing.startswith("nulltickets.storage.postgres"):
            raise StartupError("this build of nulltickets has no PostgreSQL backend") from None
        raise
    database: Database = module.PostgresDatabase(url, durability=durability, readers=readers)
    return database
