from __future__ import annotations

import contextlib
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.pgserver import PostgresServer, PostgresUnavailable, start_postgres
from tests.server import PIPELINE, TIME_SCALE, Client, Response, Server

# NULLTICKETS_TEST_BACKEND=postgres: the servers of shared_server, fresh_server and make_server
# run on PostgreSQL (a fresh database of the session's own cluster each) instead of SQLite files.
TEST_BACKEND = os.environ.get("NULLTICKETS_TEST_BACKEND", "sqlite")
if TEST_BACKEND not in ("sqlite", "postgres"):
    raise pytest.UsageError(f"NULLTICKETS_TEST_BACKEND must be sqlite or postgres: {TEST_BACKEND}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Against a standalone binary, the tests that serve from PostgreSQL are left out: the
    release binaries carry no PostgreSQL driver (the README says so, and
    test_a_postgresql_database_nobody_serves_is_one_line checks what the binary says instead);
    PostgreSQL is served by the Python package, where these tests run."""
    if not os.environ.get("NULLTICKETS_BINARY"):
        return
    reason = "the release binaries carry no PostgreSQL driver"
    for item in items:
        if "postgres" in getattr(item, "fixturenames", ()) and "/e2e/" in str(item.path):
            item.add_marker(pytest.mark.skip(reason=reason))


def server_dsn(request: pytest.FixtureRequest) -> str | None:
    """A new, empty PostgreSQL database for a server when the tests run on PostgreSQL (not for
    a test marked sqlite_file: it works on the server's SQLite file itself)."""
    if TEST_BACKEND != "postgres" or request.node.get_closest_marker("sqlite_file"):
        return None
    postgres: PostgresServer = request.getfixturevalue("postgres")
    return postgres.dsn(postgres.create_database())


def on_process(request: pytest.FixtureRequest) -> bool:
    """Whether the test's servers are processes (tests/server.py) rather than the app in this
    process (tests/inprocess.py): for every test against a binary (NULLTICKETS_BINARY), every
    test outside tests/e2e, and an e2e test marked `process` (it needs what only a process
    has: sockets and framing, signals, its log, a URL for another program)."""
    return (
        bool(os.environ.get("NULLTICKETS_BINARY"))
        or "/e2e/" not in str(request.node.path)
        or request.node.get_closest_marker("process") is not None
    )


def new_server(request: pytest.FixtureRequest, db: Path, **kw: Any) -> Any:
    """A server on `db` (started by the caller): a process or the app in this process."""
    if on_process(request):
        return Server(db, **kw)
    from tests.inprocess import InProcessServer

    if kw.get("env") or kw.get("cwd"):
        raise AssertionError("a server with an environment of its own needs a process: mark it")
    kw.pop("env", None)
    kw.pop("cwd", None)
    return InProcessServer(db, **kw)


@pytest.fixture(scope="module")
def module_servers() -> Iterator[dict[Any, Any]]:
    """The servers a module shares (module_server), stopped at its end."""
    servers: dict[Any, Any] = {}
    yield servers
    for server in servers.values():
        server.stop()


def module_server(request: pytest.FixtureRequest, name: str, **kw: Any) -> Any:
    """The server `name` the module's tests share, started on first use: one a process and
    one in this process, as each test needs (on_process)."""
    servers = request.getfixturevalue("module_servers")
    key = (name, on_process(request))
    if key not in servers:
        factory: pytest.TempPathFactory = request.getfixturevalue("tmp_path_factory")
        servers[key] = new_server(request, factory.mktemp(name) / f"{name}.db", **kw).start()
    return servers[key]


@pytest.fixture(scope="session")
def shared_process_server(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Server]:
    """One server process for the many tests that only need isolation by fresh pipelines and
    names."""
    path = tmp_path_factory.mktemp("shared") / "shared.db"
    server = Server(path, dsn=server_dsn(request)).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def shared_inprocess_server(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Any]:
    """The same, in this process."""
    from tests.inprocess import InProcessServer

    path = tmp_path_factory.mktemp("shared-inprocess") / "shared.db"
    server = InProcessServer(path, dsn=server_dsn(request)).start()
    yield server
    server.stop()


@pytest.fixture
def shared_server(request: pytest.FixtureRequest) -> Any:
    """The shared server: a process or in this process (on_process)."""
    if on_process(request):
        return request.getfixturevalue("shared_process_server")
    return request.getfixturevalue("shared_inprocess_server")


@pytest.fixture
def client(shared_server: Server) -> Iterator[Client]:
    c = shared_server.client()
    yield c
    c.close()


@pytest.fixture
def fresh_server(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Server]:
    """A server of the test's own, on its own database file."""
    server = new_server(request, tmp_path / "fresh.db", dsn=server_dsn(request)).start()
    yield server
    server.stop()


@contextlib.contextmanager
def servers_on_one_postgres(
    postgres: PostgresServer, tmp_path: Path, count: int, **kw: Any
) -> Iterator[list[Server]]:
    """`count` server processes on one new PostgreSQL database (one tracker), stopped after."""
    dsn = postgres.dsn(postgres.create_database())
    started: list[Server] = []
    try:
        for i in range(count):
            started.append(Server(tmp_path / f"s{i}.db", dsn=dsn, **kw).start(timeout=60))
        yield started
    finally:
        for server in started:
            server.stop()


@pytest.fixture
def fresh_client(fresh_server: Server) -> Iterator[Client]:
    """A client of a server of the test's own: for a test that asserts on the server's totals,
    which nothing another test left behind (a lease expiring meanwhile) may move."""
    c = fresh_server.client()
    yield c
    c.close()


@pytest.fixture
def make_server(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    """Factory for servers with custom flags; all are stopped at the end of the test."""
    servers: list[Any] = []

    def make(**kw: Any) -> Any:
        kw.setdefault("dsn", server_dsn(request))
        server = new_server(request, tmp_path / f"s{len(servers)}.db", **kw)
        servers.append(server)
        return server.start()

    yield make
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A real PostgreSQL server of the session's own (tests/pgserver.py); stopped at the end.

    When it cannot be started, every test that needs it fails with the one-line reason."""
    try:
        server = start_postgres()
    except PostgresUnavailable as exc:
        pytest.fail(f"PostgreSQL is needed and unavailable: {exc}", pytrace=False)
    yield server
    server.stop()


def migrated_database(server: PostgresServer) -> str:
    """A new database with every migration applied; its DSN."""
    import psycopg

    from nulltickets.storage.postgres.migrate import migrate

    dsn = server.dsn(server.create_database())
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn)
    return dsn


# Each database costs the server a few hundred files to sync at its shutdown checkpoint, so
# most tests share one and keep to rows of their own (fresh pipelines, roles, namespaces);
# the few that need a whole database get one, left for the end of the session (the cluster
# is removed then).
@pytest.fixture(scope="session")
def pg_shared_dsn(postgres: PostgresServer) -> str:
    """The migrated database most PostgreSQL tests share."""
    return migrated_database(postgres)


@pytest.fixture
def pg_conn(pg_shared_dsn: str) -> Iterator[Any]:
    """A connection to the shared migrated database (not autocommit)."""
    import psycopg

    with psycopg.connect(pg_shared_dsn) as conn:
        yield conn


@pytest.fixture
def pg_dsn(postgres: PostgresServer) -> str:
    """A migrated database of the test's own."""
    return migrated_database(postgres)


@pytest.fixture
def pg_empty_dsn(postgres: PostgresServer) -> str:
    """A new, empty database (no migrations) of the test's own."""
    return postgres.dsn(postgres.create_database())


# The shape of every id the server hands out: a version-7 UUID (domain/ids.py).
ID_SHAPE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


def unique(prefix: str = "x") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def pipeline_id(client: Client) -> str:
    """A fresh pipeline (todo -coder-> review -reviewer-> done) with unique roles per test."""
    return create_pipeline(client)


def create_pipeline(client: Client, definition: dict[str, Any] | None = None) -> str:
    r = client.post("/pipelines", {"name": unique("pipe"), "definition": definition or PIPELINE})
    assert r.status == 201, r.body
    return str(r.json["id"])


def pipeline_with_roles(client: Client) -> tuple[str, str, str]:
    """A fresh pipeline whose roles are unique to the caller, so claims on the shared server
    only ever see this test's tasks. Returns (pipeline_id, coder_role, reviewer_role)."""
    coder, reviewer = unique("coder"), unique("reviewer")
    definition = {
        **PIPELINE,
        "states": {
            "todo": {"agent_role": coder},
            "review": {"agent_role": reviewer},
            "done": {"terminal": True},
            "dead": {"terminal": True},
        },
    }
    return create_pipeline(client, definition), coder, reviewer


def make_task(client: Client, pipeline_id: str, **fields: Any) -> str:
    body = {"pipeline_id": pipeline_id, "title": unique("task"), "description": "", **fields}
    r = client.post("/tasks", body)
    assert r.status == 201, r.body
    return str(r.json["id"])


def claim(client: Client, role: str, agent: str = "agent-a", **fields: Any) -> Response:
    return client.post("/leases/claim", {"agent_id": agent, "agent_role": role, **fields})


def claimed(client: Client, role: str, agent: str = "agent-a", **fields: Any) -> dict[str, Any]:
    r = claim(client, role, agent, **fields)
    assert r.status == 200, (r.status, r.body)
    return dict(r.json)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def task(client: Client, task_id: str) -> dict[str, Any]:
    r = client.get(f"/tasks/{task_id}")
    assert r.status == 200, r.body
    return dict(r.json)


def events(client: Client, run_id: str) -> list[dict[str, Any]]:
    r = client.get(f"/runs/{run_id}/events?limit=1000")
    assert r.status == 200, r.body
    return list(r.json["items"])


def kinds(client: Client, run_id: str) -> list[str]:
    return [e["kind"] for e in events(client, run_id)]


def wait_for(
    what: str, probe: Callable[[], Any], timeout: float = 10.0 * TIME_SCALE, interval: float = 0.02
) -> Any:
    """Poll `probe` until it returns something truthy; fail naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def wait_until_stale(client: Client, task_id: str, run_id: str) -> dict[str, Any]:
    """Wait for the background expiry to mark `run_id` stale; the task's details then."""

    def probe() -> dict[str, Any] | None:
        details = task(client, task_id)
        run = details.get("latest_run")
        if run and run["id"] == run_id and run["status"] == "stale":
            return details
        return None

    return dict(wait_for(f"run {run_id} to go stale", probe))
