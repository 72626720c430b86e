"""The settings every connection of a PostgresDatabase opens with: no JIT compilation, the
durability's synchronous_commit, read-only reads, and the options the URL itself gives."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from nulltickets.storage.postgres import PostgresDatabase
from nulltickets.storage.postgres.backend import PostgresBackend

SETTINGS = ("jit", "synchronous_commit", "default_transaction_read_only", "statement_timeout")


def settings(b: PostgresBackend) -> dict[str, str]:
    row = b.conn.execute(
        "SELECT " + ", ".join(f"current_setting('{name}')" for name in SETTINGS)
    ).fetchone()
    assert row is not None
    return dict(zip(SETTINGS, row, strict=True))


def each_connection(db: PostgresDatabase) -> dict[str, dict[str, str]]:
    """The settings seen by a unit of work of each kind: from an event loop (every request's)
    and from a plain thread (retention, tools), writing and reading."""

    async def from_loop() -> tuple[dict[str, str], dict[str, str]]:
        return await db.write(settings), await db.read(settings)

    loop_write, loop_read = asyncio.run(from_loop())
    return {
        "loop write": loop_write,
        "loop read": loop_read,
        "thread write": db.write_sync(settings),
        "thread read": db.read_sync(settings),
    }


@pytest.mark.parametrize("durability", ["full", "normal"])
def test_no_connection_compiles_statements_with_jit(pg_dsn: str, durability: str) -> None:
    """PostgreSQL chooses JIT by a plan's estimated cost: a stage board over a few thousand
    tasks was estimated above jit_above_cost and compiled itself for seconds at every scrape
    of /metrics. PostgreSQL's own default is on."""
    db = PostgresDatabase(pg_dsn, durability=durability)
    db.open()
    try:
        seen = each_connection(db)
    finally:
        db.close()
    commit = "on" if durability == "full" else "off"
    for kind, values in seen.items():
        assert values["jit"] == "off", kind
        assert values["synchronous_commit"] == commit, kind
    assert seen["loop read"]["default_transaction_read_only"] == "on"
    assert seen["loop write"]["default_transaction_read_only"] == "off"


def test_the_urls_own_options_are_kept(pg_dsn: str) -> None:
    """A URL's `options=-c ...` (a statement_timeout, a search_path) is kept beside ours:
    libpq takes one options string, and ours alone would replace the user's."""
    url = pg_dsn + ("&" if "?" in pg_dsn else "?") + "options=-c%20statement_timeout%3D4321"
    db = PostgresDatabase(url, durability="normal")
    db.open()
    try:
        seen = each_connection(db)
    finally:
        db.close()
    for kind, values in seen.items():
        assert values["statement_timeout"] == "4321ms", kind
        assert values["jit"] == "off", kind
        assert values["synchronous_commit"] == "off", kind


def test_the_cluster_of_the_tests_has_jit_on_by_default(pg_conn: Any) -> None:
    """The cluster the tests run on has JIT on by default, so the test above could fail."""
    row = pg_conn.execute("SELECT current_setting('jit')").fetchone()
    assert row == ("on",)
