"""storage.factory: which backend `--db` names, and what happens when one cannot be had."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from nulltickets.errors import StartupError
from nulltickets.storage import factory
from nulltickets.storage.dsn import redact


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


@pytest.mark.parametrize(
    ("target", "shown", "secrets"),
    [
        (
            "postgresql://u@h/db?password=p%40ss&sslmode=x",
            "postgresql://u@h/db?password=***&sslmode=x",
            ["p%40ss", "p@ss"],
        ),
        (
            "postgres://:pw@h/db?sslpassword=key",
            "postgres://:***@h/db?sslpassword=***",
            ["key", "pw"],
        ),
        ("postgresql://u:p@ss@h:1/db", "postgresql://u:***@h:1/db", ["p@ss"]),
        ("postgresql://h:5432/db", "postgresql://h:5432/db", []),
        ("host=h password='a b' dbname=x", "host=h password=*** dbname=x", ["'a b'", "a b"]),
        ("postgresql://u:SECRET@[::1/db", "postgresql://u:***@[::1/db", ["SECRET"]),
    ],
)
def test_every_form_of_a_password_is_found_and_hidden(
    target: str, shown: str, secrets: list[str]
) -> None:
    assert factory.display_name(target) == shown
    assert sorted(factory.secrets_of(target)) == sorted(secrets)


def test_redact_takes_a_password_out_of_a_drivers_message() -> None:
    url = "postgresql://u:p%zzSECRET@127.0.0.1:1/db"
    assert redact('invalid percent-encoded token: "p%zzSECRET"', url) == (
        'invalid percent-encoded token: "***"'
    )
    assert redact(f"bad URI: {url}", url) == "bad URI: postgresql://u:***@127.0.0.1:1/db"


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
