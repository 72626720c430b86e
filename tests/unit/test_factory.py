"""storage.factory: which backend `--db` names, and what happens when one cannot be had."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from nulltickets.errors import StartupError
from nulltickets.storage import factory


def test_paths_and_file_uris_are_sqlite_and_urls_are_postgresql() -> None:
    for target in ("nulltickets.db", "/var/lib/x.db", "file:x.db?mode=rwc", "postgres.db"):
        assert not factory.is_postgres(target)
    for target in ("postgresql://u@h/db", "postgres://h/db"):
        assert factory.is_postgres(target)


def test_a_url_is_shown_without_its_password() -> None:
    shown = factory.display_name("postgresql://ada:s3cret@db.example:5433/tickets?sslmode=require")
    assert shown == "postgresql://ada:***@db.example:5433/tickets?sslmode=require"
    assert factory.display_name("postgresql://db.example/tickets") == (
        "postgresql://db.example/tickets"
    )
    assert factory.display_name("t.db") == "t.db"


def test_check_database_migrates_and_leaves_nothing_open(tmp_path: Path) -> None:
    path = tmp_path / "checked.db"
    capabilities = factory.check_database(str(path), durability="normal")
    assert capabilities.name == "sqlite" and capabilities.group_commit
    database = factory.open_database(str(path))
    try:
        current, latest = database.schema_version()
        assert current == latest
    finally:
        database.close()


def test_postgresql_without_its_backend_or_driver_is_a_one_line_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The message names the extra to install (or that this build has no backend), never an
    ImportError's traceback."""
    have_backend = importlib.util.find_spec("nulltickets.storage.postgres.database") is not None
    monkeypatch.setitem(sys.modules, "psycopg", None)  # importing it raises ImportError
    monkeypatch.setitem(sys.modules, "psycopg_pool", None)
    for name in [m for m in sys.modules if m.startswith("nulltickets.storage.postgres")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(StartupError) as caught:
        factory.make_database("postgresql://localhost/nulltickets")
    message = str(caught.value)
    assert "\n" not in message
    if have_backend:
        assert "pip install 'nulltickets[postgres]'" in message
    else:
        assert "no PostgreSQL backend" in message
