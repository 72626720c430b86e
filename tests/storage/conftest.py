"""The backends every storage test runs on, and a fresh database of each for every test.

BACKENDS maps a backend's test name to a function that makes a fresh, empty target (what
`--db` takes) and names the durability to open it with. The `backend` fixture is parametrized
over it, so every test of tests/storage that asks for `database` (or `opened`, `target`) runs
once per backend: SQLite with durability `full` (its writer answers and notifies only after
its WAL sync thread synced the commit), SQLite with `normal`, and PostgreSQL (a database of
the session's own cluster, copied from a migrated template so that each costs one CREATE
DATABASE). The suite opens databases through storage.factory and sees only the storage ports.

A third backend plugs in here: one more entry in BACKENDS (a function giving a fresh target
for it), and every test of the suite runs on it too.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nulltickets.storage.factory import open_database
from nulltickets.storage.ports import Database
from tests.pgserver import PostgresServer

# A fresh target for one test: (what `--db` takes, the durability to open it with).
Target = tuple[str, str]


def sqlite_full(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    return str(tmp_path / "storage.db"), "full"


def sqlite_normal(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    return str(tmp_path / "storage.db"), "normal"


def postgresql(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    """A new database of the session's own PostgreSQL (tests/pgserver.py), migrated already."""
    server: PostgresServer = request.getfixturevalue("postgres")
    template: str = request.getfixturevalue("pg_storage_template")
    name = f"s_{uuid.uuid4().hex[:16]}"
    with server.admin() as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    return server.dsn(name), "normal"


BACKENDS: dict[str, Callable[[pytest.FixtureRequest, Path], Target]] = {
    "sqlite-full": sqlite_full,
    "sqlite-normal": sqlite_normal,
    "postgresql": postgresql,
}


@pytest.fixture(scope="session")
def pg_storage_template(postgres: PostgresServer) -> str:
    """A migrated database that every PostgreSQL test database is copied from (nobody connects
    to it after its migration, as CREATE DATABASE ... TEMPLATE requires)."""
    import psycopg

    from nulltickets.storage.postgres.migrate import migrate

    name = postgres.create_database()
    with psycopg.connect(postgres.dsn(name), autocommit=True) as conn:
        migrate(conn)
    return name


@pytest.fixture(params=list(BACKENDS))
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def target(request: pytest.FixtureRequest, backend: str, tmp_path: Path) -> Target:
    """A fresh database of the backend: (what `--db` names, its durability)."""
    return BACKENDS[backend](request, tmp_path)


@pytest.fixture
def opened(target: Target) -> Iterator[Callable[[], Database]]:
    """Open databases on the test's target (each one standing for a server); all are closed at
    the end of the test."""
    databases: list[Database] = []
    url, durability = target

    def open_one() -> Database:
        database = open_database(url, durability=durability)
        databases.append(database)
        return database

    yield open_one
    for database in reversed(databases):
        database.close()


@pytest.fixture
def database(opened: Callable[[], Database]) -> Database:
    return opened()
