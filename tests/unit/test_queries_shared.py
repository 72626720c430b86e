"""Each backend's effective set of queries: storage/queries.sql (what both run word for word)
and its own queries.sql (what differs), each name in exactly one of the two."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from nulltickets.storage.queries import SHARED, load_backend_queries, load_queries

STORAGE = Path(__file__).resolve().parents[2] / "src" / "nulltickets" / "storage"
BACKENDS = ("sqlite", "postgres")

SHARED_QUERIES = load_queries(SHARED, "queries.sql")
OWN = {b: load_queries(f"nulltickets.storage.{b}", "queries.sql") for b in BACKENDS}
EFFECTIVE = {b: load_backend_queries(f"nulltickets.storage.{b}") for b in BACKENDS}

# Where the statements live. A statement copied into both backends' files (or a shared one
# copied into one of them) changes these and fails the tests below that say why; a statement
# added in its right place changes them too: then update them here.
COUNTS = {"shared": 67, "sqlite": 57, "postgres": 83}

# Statements only SQLite's file has, and why (PostgreSQL's own are in
# tests/postgres/test_queries.py).
SQLITE_ONLY: dict[str, str] = {
    name: "SqliteBackend.prune_tasks, a statement a table (PostgreSQL's: prune_delete, one)"
    for name in (
        "prune_delete_events",
        "prune_delete_leases",
        "prune_delete_artifacts",
        "prune_delete_spans",
        "prune_delete_runs",
        "prune_delete_tasks",
    )
}

# The backends' helpers that run a query by name, and the variable a name is chosen into.
RUNNERS = {"_all", "_one", "_exec", "_insert", "_value", "_cur"}
NAME = re.compile(r"[a-z][a-z0-9_]*")


def test_the_statements_live_where_the_counts_say() -> None:
    counts = {"shared": len(SHARED_QUERIES)} | {b: len(OWN[b]) for b in BACKENDS}
    effective = {b: len(EFFECTIVE[b]) for b in BACKENDS}
    print(f"statements by file: {counts}; effective per backend: {effective}")
    assert counts == COUNTS
    assert effective == {b: COUNTS["shared"] + COUNTS[b] for b in BACKENDS}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_backends_file_defines_no_shared_name(backend: str) -> None:
    assert SHARED_QUERIES.keys() & OWN[backend].keys() == set()


def test_no_statement_is_written_the_same_in_both_backends_files() -> None:
    """The driver's text (comments and indentation aside) of a name in both backends' files
    differs; the same text belongs once in storage/queries.sql."""
    both = OWN["sqlite"].keys() & OWN["postgres"].keys()
    same = sorted(n for n in both if OWN["sqlite"][n] == OWN["postgres"][n])
    assert same == [], f"the same on both backends, move to storage/queries.sql: {same}"
    texts = set(OWN["sqlite"].values()) & set(OWN["postgres"].values())
    assert texts == set(), "a statement of the same text under another name"


def test_a_name_translated_for_one_backend_is_translated_for_the_other() -> None:
    """Every name of the SQLite file is in the PostgreSQL one but SQLITE_ONLY's; the rest of the
    PostgreSQL file is its own statements (tests/postgres/test_queries.py says which and why)."""
    assert OWN["sqlite"].keys() - SQLITE_ONLY.keys() <= OWN["postgres"].keys()
    assert SQLITE_ONLY.keys() <= OWN["sqlite"].keys()


def test_a_shared_name_in_a_backends_file_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "some_backend"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "queries.sql").write_text(
        "-- own_query --\nSELECT 1;\n\n-- get_pipeline --\nSELECT 2;\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="some_backend redefines shared queries: get_pipeline"):
        load_backend_queries("some_backend")
    (package / "queries.sql").write_text("-- own_query --\nSELECT 1;\n")
    assert load_backend_queries("some_backend") == SHARED_QUERIES | {"own_query": "SELECT 1;"}


def _chosen_name(node: ast.AST) -> ast.expr | None:
    """What names a query in `node`: a runner's first argument, Q[...], or `name = "..."`."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.args[0] if node.func.attr in RUNNERS and node.args else None
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
        return node.slice if node.value.id == "Q" else None
    if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["name"]:
        value = node.value  # a query's name, not walsync's `name = "a Python thread"`
        is_name = isinstance(value, ast.Constant) and NAME.fullmatch(str(value.value))
        return value if is_name else None
    return None


def _names_in(paths: list[Path]) -> tuple[set[str], set[str]]:
    """(the names of the queries the code runs; every snake_case string constant in it)."""
    run: set[str] = set()
    constants: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and NAME.fullmatch(str(node.value)):
                constants.add(str(node.value))
            named = _chosen_name(node)
            if isinstance(named, ast.Constant) and isinstance(named.value, str):
                run.add(named.value)
    return run, constants


def _code_of(backend: str) -> list[Path]:
    return [STORAGE / "backend.py", *sorted((STORAGE / backend).glob("*.py"))]


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_query_the_code_runs_is_in_its_backends_set(backend: str) -> None:
    run, _ = _names_in(_code_of(backend))
    assert len(run) > 80  # the scan finds the code's queries
    assert run - EFFECTIVE[backend].keys() == set()


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_query_of_a_backends_set_is_named_in_its_code(backend: str) -> None:
    _, constants = _names_in(_code_of(backend))
    assert EFFECTIVE[backend].keys() - constants == set()
