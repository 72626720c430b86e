"""The backends every contract test runs on.

A backend is a function giving a fresh, empty database target (what `--db` takes) for one
test. The suite opens it through storage.factory, so it sees only the storage ports. Every
contract test runs on each backend in BACKENDS: SQLite (a file of the test's own), with
durability `normal` and with `full` (whose writer answers and notifies only after its WAL sync
thread has synced the commit), and PostgreSQL (a new database of the session's own cluster,
tests/conftest.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest

from nulltickets.domain.clock import FixedClock
from nulltickets.domain.commands import CreatePipeline
from nulltickets.service import Outcome, Recorded, Service
from nulltickets.storage.factory import open_database
from nulltickets.storage.ports import Database
from tests.server import PIPELINE

T = TypeVar("T")


def sqlite(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return str(tmp_path / "contract.db")


def postgresql(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A new, empty database of the session's own PostgreSQL (tests/pgserver.py)."""
    server = request.getfixturevalue("postgres")
    return str(server.dsn(server.create_database()))


BACKENDS: dict[str, Callable[[pytest.FixtureRequest, Path], str]] = {
    "sqlite": sqlite,
    "sqlite-full": sqlite,
    "postgresql": postgresql,
}
DURABILITY = {"sqlite-full": "full"}  # else "normal"


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def database_url(request: pytest.FixtureRequest, backend: str, tmp_path: Path) -> str:
    """A fresh database of each backend, as `--db` names it."""
    return BACKENDS[backend](request, tmp_path)


@pytest.fixture
def opened(backend: str, database_url: str) -> Iterator[Callable[[], Database]]:
    """Open more databases on the same target (more servers on one database); all are closed
    at the end of the test."""
    databases: list[Database] = []
    durability = DURABILITY.get(backend, "normal")

    def open_one() -> Database:
        database = open_database(database_url, durability=durability)
        databases.append(database)
        return database

    yield open_one
    for database in reversed(databases):
        database.close()


@pytest.fixture
def database(opened: Callable[[], Database]) -> Database:
    return opened()


@pytest.fixture
def clock() -> FixedClock:
    return FixedClock()


@pytest.fixture
def service(database: Database, clock: FixedClock) -> Service:
    return Service(database, clock=clock, rand=lambda: 0.5)


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coroutine)


def value(result: Outcome[T] | Recorded) -> T:
    """The value of a fresh outcome (a test that expects no replay)."""
    assert isinstance(result, Outcome), result
    return result.value


def record(outcome: Outcome[Any]) -> Recorded:
    """The answer a caller records: here, like HTTP, a status and the JSON body."""
    status = {"created": 201, "ok": 200, "empty": 204}[outcome.kind.value]
    return Recorded(status, msgspec.json.encode(outcome.value))


def make_pipeline(service: Service, name: str = "p", definition: Any = None) -> str:
    raw = msgspec.Raw(msgspec.json.encode(PIPELINE if definition is None else definition))
    return value(run(service.create_pipeline(CreatePipeline(name, raw))))
