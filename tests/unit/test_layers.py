"""The import graph keeps the architecture: http -> service -> core/domain -> storage, one way."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "nulltickets"
CEXT = Path(__file__).resolve().parents[2] / "cext"


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def modules(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.py"))


@pytest.mark.parametrize("path", modules(SRC / "domain") + modules(CEXT), ids=str)
def test_domain_and_core_import_nothing_from_storage_http_or_service(path: Path) -> None:
    bad = {
        m
        for m in imports_of(path)
        if m.startswith(("nulltickets.storage", "nulltickets.http", "nulltickets.service", "apsw"))
    }
    assert not bad, f"{path.name} imports {bad}"


ABOVE_STORAGE = [p for p in modules(SRC) if SRC / "storage" not in p.parents]
BACKENDS = ("nulltickets.storage.sqlite", "nulltickets.storage.postgres")
DRIVERS = ("apsw", "psycopg", "psycopg_pool")
# Modules allowed to name the SQLite backend: the maintenance commands, which work on a SQLite
# file as such (backup, vacuum).
SQLITE_TOOLS = {SRC / "cli" / "admin.py", SRC / "cli" / "db.py"}


@pytest.mark.parametrize("path", ABOVE_STORAGE, ids=lambda p: str(p.relative_to(SRC)))
def test_nothing_above_storage_imports_a_backend_or_a_driver(path: Path) -> None:
    found = imports_of(path)
    bad = {m for m in found if m.split(".")[0] in DRIVERS}
    if path not in SQLITE_TOOLS:
        bad |= {m for m in found if m.startswith(BACKENDS)}
    else:
        bad |= {m for m in found if m.startswith("nulltickets.storage.postgres")}
    assert not bad, f"{path.relative_to(SRC)} imports {bad}"


@pytest.mark.parametrize("path", modules(SRC / "service"), ids=lambda p: p.name)
def test_the_service_sees_storage_only_through_the_ports_and_knows_no_http(path: Path) -> None:
    found = imports_of(path)
    storage = {m for m in found if m.startswith("nulltickets.storage")}
    assert storage <= {"nulltickets.storage.backend", "nulltickets.storage.ports"}, path
    assert not {m for m in found if m.startswith("nulltickets.http")}, path


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _eager_imports(path: Path, package: str) -> set[str]:
    """The modules `path` imports when it runs: at any level (a function's import too), but
    not under `if TYPE_CHECKING:`; `from a import b` counts as a.b when that is a module."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def test_no_import_circle_in_the_package() -> None:
    """Modules import one way: a circle (even one a late import hides) fails."""
    paths = {_module_name(p): p for p in modules(SRC)}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = {m for m in _eager_imports(path, package) if m in paths and m != name}
        # A package's __init__ importing its own modules is how a package is put together.
        graph[name] = {m for m in deps if not (path.name == "__init__.py" and m.startswith(name))}
    circles = [c for c in _strongly_connected(graph) if len(c) > 1]
    assert not circles, circles


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_http_opens_the_database_only_through_the_factory() -> None:
    for path in modules(SRC / "http"):
        storage = {m for m in imports_of(path) if m.startswith("nulltickets.storage")}
        assert storage <= {"nulltickets.storage.factory", "nulltickets.storage.ports"}, path


def test_the_ports_and_the_factory_import_no_backend_at_import_time() -> None:
    for name in ("ports.py", "backend.py", "factory.py", "queries.py", "__init__.py"):
        top_level = {
            node.module
            for node in ast.parse((SRC / "storage" / name).read_text()).body
            if isinstance(node, ast.ImportFrom) and node.module
        } | {
            alias.name
            for node in ast.parse((SRC / "storage" / name).read_text()).body
            if isinstance(node, ast.Import)
            for alias in node.names
        }
        bad = {m for m in top_level if m.startswith(BACKENDS) or m.split(".")[0] in DRIVERS}
        assert not bad, f"storage/{name} imports {bad} when imported"


def test_storage_imports_nothing_above_it() -> None:
    for path in modules(SRC / "storage"):
        above = {
            m for m in imports_of(path) if m.startswith(("nulltickets.http", "nulltickets.service"))
        }
        assert not above, f"{path} imports {above}"


# The command line's modules: what a person runs. They reach the database only through
# storage/sqlite's maintenance and connection functions, never the driver itself.
CLI_MODULES = [*modules(SRC / "cli"), SRC / "client" / "remote.py", SRC / "logs.py"]


@pytest.mark.parametrize(
    "path",
    [*CLI_MODULES, *modules(SRC / "worker"), *modules(SRC / "server"), SRC / "config.py"],
    ids=lambda p: str(p.relative_to(SRC)),
)
def test_the_command_line_does_not_import_the_driver(path: Path) -> None:
    found = imports_of(path)
    assert not {m for m in found if m == "apsw" or m.startswith("apsw.")}, found
    assert "nulltickets.storage.sqlite.backend" not in found


def test_client_side_commands_do_not_open_the_database() -> None:
    client_side = [SRC / "cli" / "admin.py", SRC / "cli" / "agent.py", SRC / "client" / "remote.py"]
    for path in [*client_side, *modules(SRC / "worker")]:
        storage = {m for m in imports_of(path) if m.startswith("nulltickets.storage")}
        assert not storage, f"{path.relative_to(SRC)} imports {storage}"


POSTGRES = ("psycopg", "psycopg_pool", "nulltickets.storage.postgres")
# (Nothing above storage imports them: test_nothing_above_storage_imports_a_backend_or_a_driver.)


@pytest.mark.parametrize(
    "path",
    [
        SRC / "storage" / "backend.py",
        SRC / "storage" / "queries.py",
        *modules(SRC / "storage" / "sqlite"),
    ],
    ids=str,
)
def test_the_sqlite_storage_runs_without_the_postgres_extra(path: Path) -> None:
    bad = {m for m in imports_of(path) if m.startswith(POSTGRES)}
    assert not bad, f"{path.name} imports {bad}"


def test_the_postgres_storage_imports_nothing_of_sqlite() -> None:
    for path in modules(SRC / "storage" / "postgres"):
        bad = {m for m in imports_of(path) if m.startswith(("apsw", "nulltickets.storage.sqlite"))}
        assert not bad, f"{path} imports {bad}"


def test_the_layer_tests_see_the_postgres_storage() -> None:
    assert SRC / "storage" / "postgres" / "migrate.py" in modules(SRC / "storage" / "postgres")
    assert len(ABOVE_STORAGE) > 10


# The top level holds only what every part shares; the rest lives in the package of its part
# (cli/, client/, worker/, server/, http/, service/, ...).
SHARED = {"__init__.py", "__main__.py", "config.py", "errors.py", "logs.py", "lifetime.py"}


def test_the_top_level_keeps_only_what_every_part_shares() -> None:
    top = {p.name for p in SRC.glob("*.py")}
    assert top <= SHARED, sorted(top - SHARED)
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    assert {"cli", "client", "worker", "server", "http", "service", "storage"} <= packages
