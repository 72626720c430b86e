"""A PostgreSQL URL's password is never shown, and the commands that open the database
themselves understand such a URL: `doctor` checks the database (reachable, migrations against
this build's, writable, in use, what serve would do), `backup` says to use pg_dump. Every
output of `doctor`, `backup`, `serve` (its start line and its whole log), `migrate` and a
usage error is searched for the password, on a real PostgreSQL cluster (trust
authentication: any password connects)."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.cli import one_line, run_cli
from tests.pgserver import PostgresServer, free_port
from tests.server import Server

pytestmark = [pytest.mark.e2e, pytest.mark.process]


@pytest.fixture
def password() -> str:
    return f"pw-{uuid.uuid4().hex[:12]}"


def with_password(postgres: PostgresServer, database: str, password: str) -> str:
    return f"postgresql://postgres:{password}@127.0.0.1:{postgres.port}/{database}"


def expected_version() -> int:
    from nulltickets.storage.postgres.migrate import migrations

    return len(migrations())


def clean(
    result: subprocess.CompletedProcess[str], password: str
) -> subprocess.CompletedProcess[str]:
    """The command's outputs, having checked that neither holds the password."""
    assert password not in result.stdout, result.stdout
    assert password not in result.stderr, result.stderr
    return result


def doctor(home: Path, url: str, password: str, *more: str) -> tuple[int, dict[str, Any]]:
    result = clean(run_cli("doctor", "--db", url, "--json", *more, home=home), password)
    text = clean(run_cli("doctor", "--db", url, *more, home=home), password)
    assert text.returncode == result.returncode
    assert (
        text.stdout.rstrip()
        .splitlines()[-1]
        .endswith("ok" if result.returncode == 0 else "attention")
    )
    return result.returncode, json.loads(result.stdout)


# --- doctor ------------------------------------------------------------------------------------


def test_doctor_on_a_migrated_database(
    postgres: PostgresServer, pg_dsn: str, tmp_path: Path, password: str
) -> None:
    url = with_password(postgres, pg_dsn.rsplit("/", 1)[1], password)
    status, report = doctor(tmp_path, url, password)
    assert status == 0, report
    assert report["engine"] == "postgresql"
    assert (
        report["database"]
        == f"postgresql://postgres:***@127.0.0.1:{postgres.port}/" + (pg_dsn.rsplit("/", 1)[1])
    )
    assert report["reachable"] and report["server_version"]
    assert report["schema_version"] == report["expected_version"] == expected_version()
    assert report["contents"] == "nulltickets" and report["writable"] is True
    assert report["integrity"] == "ok" and report["size_bytes"] > 0
    assert report["on_start"] == "nothing to migrate: serve it as it is"
    assert report["ok"] and report["problems"] == []
    text = run_cli("doctor", "--db", url, home=tmp_path).stdout
    assert f"schema       version {expected_version()}, this build's {expected_version()}" in text
    assert "postgresql://postgres:***@" in text


def test_doctor_on_an_empty_database_says_serve_creates_the_tables(
    postgres: PostgresServer, pg_empty_dsn: str, tmp_path: Path, password: str
) -> None:
    url = with_password(postgres, pg_empty_dsn.rsplit("/", 1)[1], password)
    status, report = doctor(tmp_path, url, password)
    assert status == 0, report
    assert (report["contents"], report["schema_version"]) == ("empty", 0)
    assert report["on_start"] == f"create the tables: migrate from 0 to {expected_version()}"


def test_doctor_on_another_programs_database_needs_attention(
    postgres: PostgresServer, pg_empty_dsn: str, tmp_path: Path, password: str
) -> None:
    with psycopg.connect(pg_empty_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY)")
    url = with_password(postgres, pg_empty_dsn.rsplit("/", 1)[1], password)
    status, report = doctor(tmp_path, url, password)
    assert status == 1
    assert report["contents"] == "foreign"
    assert "1 tables of another program" in report["problems"][0]


def test_doctor_on_a_newer_schema_says_the_server_refuses(
    postgres: PostgresServer, pg_dsn: str, tmp_path: Path, password: str
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO nulltickets_schema (version, name, applied_at_ms) VALUES (99, 'x', 0)"
        )
    url = with_password(postgres, pg_dsn.rsplit("/", 1)[1], password)
    status, report = doctor(tmp_path, url, password)
    assert status == 1
    assert report["on_start"].startswith("refuse to start: schema version 99 is newer")


def test_doctor_sees_a_running_server_and_a_read_only_database(
    postgres: PostgresServer, pg_dsn: str, tmp_path: Path, password: str
) -> None:
    name = pg_dsn.rsplit("/", 1)[1]
    url = with_password(postgres, name, password)
    server = Server(tmp_path / "s.db", dsn=url).start()
    try:
        status, report = doctor(tmp_path, url, password)
        assert status == 0, report
        assert report["in_use"] is True and report["sessions"] >= 1
    finally:
        assert server.stop() == 0
    with postgres.admin() as conn:
        conn.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
    status, report = doctor(tmp_path, url, password)
    assert status == 1 and report["writable"] is False
    assert report["on_start"] == "refuse to start: the database is read-only " + (
        "(a standby, or read-only by default)"
    )


@pytest.mark.parametrize("where", ["no-server", "no-database", "echoed-by-libpq"])
def test_doctor_that_cannot_connect_says_why_without_the_password(
    postgres: PostgresServer, tmp_path: Path, password: str, where: str
) -> None:
    url = {
        "no-server": f"postgresql://postgres:{password}@127.0.0.1:{free_port()}/db",
        "no-database": with_password(postgres, "no_such_database", password),
        # libpq quotes a password it cannot decode in its error message.
        "echoed-by-libpq": f"postgresql://postgres:%zz{password}@127.0.0.1:{postgres.port}/db",
    }[where]
    status, report = doctor(tmp_path, url, password)
    assert status == 1 and report["reachable"] is False
    assert report["on_start"].startswith("refuse to start: cannot connect: ")
    if where == "no-database":
        assert "no_such_database" in report["on_start"]


def test_doctor_finds_the_url_in_the_config_file(
    postgres: PostgresServer, pg_dsn: str, tmp_path: Path, password: str
) -> None:
    url = with_password(postgres, pg_dsn.rsplit("/", 1)[1], password)
    config = tmp_path / "nt.json"
    config.write_text(json.dumps({"db": url}))
    result = clean(run_cli("doctor", "--config", str(config), "--json", home=tmp_path), password)
    assert result.returncode == 0, result
    report = json.loads(result.stdout)
    assert (report["engine"], report["contents"]) == ("postgresql", "nulltickets")


# --- backup ------------------------------------------------------------------------------------


def test_backup_of_a_postgresql_database_says_to_use_pg_dump(
    postgres: PostgresServer, pg_dsn: str, tmp_path: Path, password: str
) -> None:
    url = with_password(postgres, pg_dsn.rsplit("/", 1)[1], password)
    dest = tmp_path / "copy.dump"
    result = clean(run_cli("backup", str(dest), "--db", url, home=tmp_path), password)
    assert result.returncode == 1 and result.stdout == ""
    line = one_line(result)
    assert "pg_dump" in line and "pg_restore" in line and "postgresql://postgres:***@" in line
    assert not dest.exists()


# --- serve, migrate, usage ---------------------------------------------------------------------


@pytest.mark.parametrize("form", ["userinfo", "query"])
def test_serve_never_logs_the_password(
    postgres: PostgresServer, pg_dsn: str, tmp_path: Path, password: str, form: str
) -> None:
    name = pg_dsn.rsplit("/", 1)[1]
    url = (
        with_password(postgres, name, password)
        if form == "userinfo"
        else f"postgresql://postgres@127.0.0.1:{postgres.port}/{name}?password={password}"
    )
    server = Server(tmp_path / "s.db", dsn=url, args=["--access-log", "--log-level", "debug"])
    server.start()
    try:
        client = server.client()
        assert client.get("/health").status == 200
        assert client.get("/tasks").status == 200
        client.close()
    finally:
        assert server.stop() == 0
    log = server.output()
    start = next(line for line in log.splitlines() if "listening on" in line)
    assert ("postgres:***@" if form == "userinfo" else "password=***") in start
    assert "GET /tasks" in log  # the access log was on
    assert password not in log


@pytest.mark.parametrize("where", ["no-database", "echoed-by-libpq"])
def test_serve_that_cannot_open_the_database_says_why_without_the_password(
    postgres: PostgresServer, tmp_path: Path, password: str, where: str
) -> None:
    url = {
        "no-database": with_password(postgres, "no_such_database", password),
        "echoed-by-libpq": f"postgresql://postgres:%zz{password}@127.0.0.1:{postgres.port}/db",
    }[where]
    port = free_port()
    result = clean(run_cli("serve", "--port", str(port), "--db", url, home=tmp_path), password)
    assert result.returncode == 1
    assert one_line(result).startswith("cannot open PostgreSQL database postgresql://postgres:***@")


def test_migrate_never_shows_the_password(
    postgres: PostgresServer, pg_empty_dsn: str, tmp_path: Path, password: str
) -> None:
    source = tmp_path / "tracker.db"
    Server(source).start().stop()
    url = with_password(postgres, pg_empty_dsn.rsplit("/", 1)[1], password)
    done = clean(run_cli("migrate", "--from", str(source), "--to", url, home=tmp_path), password)
    assert done.returncode == 0, done.stderr
    assert "postgresql://postgres:***@" in done.stdout
    bad = f"postgresql://postgres:%zz{password}@127.0.0.1:{postgres.port}/db"
    failed = clean(run_cli("migrate", "--from", str(source), "--to", bad, home=tmp_path), password)
    assert failed.returncode == 1 and failed.stderr.count("\n") == 1


def test_a_usage_error_does_not_repeat_the_password(tmp_path: Path, password: str) -> None:
    url = f"postgresql://u:{password}@127.0.0.1:1/db"
    result = clean(run_cli("doctor", "--db", url, "--no-such-flag", url, home=tmp_path), password)
    assert result.returncode == 2 and "unrecognized arguments" in result.stderr


@pytest.mark.parametrize("encoding", ["SQL_ASCII", "LATIN1"])
def test_serve_on_a_database_not_in_utf8_refuses_in_one_line(
    postgres: PostgresServer, tmp_path: Path, password: str, encoding: str
) -> None:
    """Task text is Unicode: a database in another encoding would refuse it (or, in SQL_ASCII,
    keep bytes no one can read back), so the server refuses to start on it and says what to do."""
    name = f"t_{uuid.uuid4().hex[:16]}"
    with postgres.admin() as admin:
        admin.execute(
            f"CREATE DATABASE \"{name}\" TEMPLATE template0 ENCODING '{encoding}' "
            "LC_COLLATE 'C' LC_CTYPE 'C'"
        )
    url = with_password(postgres, name, password)
    result = clean(
        run_cli("serve", "--port", str(free_port()), "--db", url, home=tmp_path), password
    )
    assert result.returncode == 1
    line = one_line(result)
    assert line.startswith("cannot open PostgreSQL database postgresql://postgres:***@")
    assert f"encoding {encoding}" in line and "UTF8" in line
    with psycopg.connect(postgres.dsn(name)) as conn:  # nothing was created in it
        assert conn.execute("SELECT to_regclass('nulltickets_schema')").fetchone() == (None,)
