"""The backends every storage test runs on, and a fresh database of each for every test.

BACKENDS maps a backend's test name to a function that makes a fresh, empty target (what
`--db` takes) and names the durability to open it with. The `backend` fixture is parametrized
over it, so every test of tests/storage that asks for `database` (or `opened`, `target`) runs
once per backend: SQLite with durability `full` (its writer answers and notifies only after
its WAL sync thread synced the commit), SQLite with `normal` (each a new file of the test's
own), and PostgreSQL (the session's one migrated database, emptied before each test). The
suite opens databases through storage.factory and sees only the storage ports.

A third backend plugs in here: one more entry in BACKENDS (a function giving a fresh target
for it), and every test of the suite runs on it too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nulltickets.storage.factory import open_database
from nulltickets.storage.ports import Database
from tests.conftest import migrated_database
from tests.pgserver import PostgresServer

# A fresh target for one test: (what `--db` takes, the durability to open it with).
Target = tuple[str, str]


def sqlite_full(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    return str(tmp_path / "storage.db"), "full"


def sqlite_normal(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    return str(tmp_path / "storage.db"), "normal"


def postgresql(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    """The session's one migrated database of its own PostgreSQL (tests/pgserver.py), emptied:
    every table's rows deleted and every sequence restarted, so the test starts as on a new one.
    (A database per test would cost the cluster a few hundred files each to sync at its
    shutdown checkpoint: a minute for this suite.)"""
    dsn: str = request.getfixturevalue("pg_storage_dsn")
    import psycopg

    # DELETE rather than TRUNCATE: a TRUNCATE gives each table and index new files to sync,
    # which costs more than deleting a test's few rows. Foreign keys are not checked meanwhile
    # (the session's own superuser), so the order of the tables does not matter.
    with psycopg.connect(dsn) as conn:
        conn.execute("SET LOCAL session_replication_role = replica")
        for (table,) in conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public'"
            " AND tablename <> 'nulltickets_schema'"
        ).fetchall():
            conn.execute(f'DELETE FROM "{table}"')
        for (sequence,) in conn.execute(
            "SELECT sequencename FROM pg_sequences WHERE schemaname = 'public'"
        ).fetchall():
            conn.execute(f'ALTER SEQUENCE "{sequence}" RESTART')
    return dsn, "normal"


BACKENDS: dict[str, Callable[[pytest.FixtureRequest, Path], Target]] = {
    "sqlite-full": sqlite_full,
    "sqlite-normal": sqlite_normal,
    "postgresql": postgresql,
}


@pytest.fixture(scope="session")
def pg_storage_dsn(postgres: PostgresServer) -> str:
    """The migrated database the suite's PostgreSQL tests take in turn."""
    return migrated_database(postgres)


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
