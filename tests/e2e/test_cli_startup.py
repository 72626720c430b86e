"""The command line as a person meets it: unknown words fail with the usage, and every start-up
failure is exactly one line on stderr naming the file or setting, with status 1."""

from __future__ import annotations

import json
import os
import re
import socket
import time
from pathlib import Path

import pytest

from tests.cli import one_line, run_cli
from tests.server import Server, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.process]
AS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


def nothing_listens(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.parametrize(
    "argv",
    [["tasks-list"], ["frobnicate", "--port", "0"], ["--no-such-flag"], ["serve", "extra"]],
)
def test_an_unknown_word_or_flag_exits_2_with_the_usage_and_starts_nothing(
    argv: list[str], home: Path
) -> None:
    port = free_port()
    result = run_cli(*[a if a != "0" else str(port) for a in argv], home=home, timeout=30)
    assert result.returncode == 2, result
    assert result.stderr.startswith("usage: nulltickets"), result.stderr
    assert "error:" in result.stderr and result.stdout == ""
    assert nothing_listens(port)


def test_worker_help_prints_help(home: Path) -> None:
    result = run_cli("worker", "--help", home=home)
    assert result.returncode == 0
    assert result.stdout.startswith("usage: nulltickets worker") and "--role" in result.stdout


def test_pause_with_an_empty_agent_id_is_one_line_and_status_1(home: Path) -> None:
    result = run_cli("pause", "--agent-id", "", home=home)
    assert result.returncode == 1
    assert one_line(result) == "--agent-id must not be empty"


def start_error(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """Start the server with ARGS on a free port; it must refuse: one line, status 1."""
    port = free_port()
    result = run_cli(
        "serve", "--port", str(port), *args, home=tmp_path / "home", env=env, cwd=tmp_path
    )
    assert result.returncode == 1, result
    assert nothing_listens(port)
    return one_line(result)


def test_a_file_that_is_not_a_database(tmp_path: Path) -> None:
    path = tmp_path / "notes.db"
    path.write_text("these are my notes, not a database\n" * 200)
    assert start_error(tmp_path, "--db", str(path)) == f"{path} is not an SQLite database"


def test_a_database_directory_that_cannot_be_created(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    line = start_error(tmp_path, "--db", str(tmp_path / "afile" / "sub" / "t.db"))
    assert line.startswith(f"cannot create the database directory {tmp_path / 'afile'}")


def test_a_database_path_that_is_a_directory(tmp_path: Path) -> None:
    (tmp_path / "dir.db").mkdir()
    line = start_error(tmp_path, "--db", str(tmp_path / "dir.db"))
    assert line.startswith("cannot open database") and "dir.db" in line


def make_database(path: Path) -> Path:
    server = Server(path).start()
    server.stop()
    return path


def test_a_database_opened_read_only(tmp_path: Path) -> None:
    db = make_database(tmp_path / "t.db")
    line = start_error(tmp_path, "--db", f"file:{db}?mode=ro")
    assert line == f"database file:{db}?mode=ro is read-only"


@pytest.mark.skipif(AS_ROOT, reason="root writes to a file whatever its mode says")
def test_a_read_only_file(tmp_path: Path) -> None:
    db = make_database(tmp_path / "t.db")
    db.chmod(0o444)
    assert "is not writable" in start_error(tmp_path, "--db", str(db))


@pytest.mark.skipif(AS_ROOT, reason="root reads a file whatever its mode says")
def test_an_unreadable_file(tmp_path: Path) -> None:
    db = make_database(tmp_path / "t.db")
    db.chmod(0o200)
    assert str(db) in start_error(tmp_path, "--db", str(db))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--port", "70000"], "--port must be a port number 0..65535, got '70000'"),
        (["--host", "no-such-host.invalid"], "cannot resolve --host 'no-such-host.invalid'"),
        (["--host", ""], "--host must not be empty"),
        (["--config", "absent.json"], "config file absent.json does not exist"),
        (["--durability", "fast"], "--durability must be one of full, normal, got 'fast'"),
    ],
)
def test_a_bad_setting(args: list[str], message: str, tmp_path: Path) -> None:
    assert start_error(tmp_path, *args).startswith(message)


SHORT_TOKEN = "fifteen-chars.."  # one short of the 16 a non-loopback server needs


@pytest.mark.parametrize(
    ("where", "named"),
    [("flag", "--token"), ("env", "NULLTICKETS_TOKEN"), ("config", "'api_token' in ")],
)
def test_a_non_loopback_host_refuses_a_short_token(where: str, named: str, tmp_path: Path) -> None:
    args = ["--host", "0.0.0.0", "--db", str(tmp_path / "t.db")]
    env = None
    if where == "flag":
        args += ["--token", SHORT_TOKEN]
    elif where == "env":
        env = {"NULLTICKETS_TOKEN": SHORT_TOKEN}
    else:
        config = tmp_path / "nt.json"
        config.write_text(json.dumps({"api_token": SHORT_TOKEN}))
        args += ["--config", str(config)]
    line = start_error(tmp_path, *args, env=env)
    assert line.startswith(f"refusing to listen on 0.0.0.0 with a {named}"), line
    assert "shorter than 16 characters" in line, line
    assert SHORT_TOKEN not in line


def test_a_one_character_token_is_refused_and_sixteen_start(tmp_path: Path) -> None:
    line = start_error(
        tmp_path, "--host", "0.0.0.0", "--token", "a", "--db", str(tmp_path / "t.db")
    )
    assert "shorter than 16 characters" in line, line
    server = Server(tmp_path / "long.db", token=SHORT_TOKEN + "!", args=["--host", "0.0.0.0"])
    server.start()
    try:
        assert server.client(SHORT_TOKEN + "!").get("/tasks").status == 200
    finally:
        assert server.stop() == 0
    # On loopback any token is accepted, as before.
    server = Server(tmp_path / "loop.db", token="a").start()
    assert server.stop() == 0


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("NULLTICKETS_LOG_FORMAT", "xml"),
        ("NULLTICKETS_MAX_BODY_BYTES", "lots"),
        ("NULLTICKETS_ACCESS_LOG", "perhaps"),
        ("NULLTICKETS_HOST", "no-such-host.invalid"),
    ],
)
def test_a_bad_environment_variable_names_it(var: str, value: str, tmp_path: Path) -> None:
    line = start_error(tmp_path, env={var: value})
    assert line.startswith(f"{var} must be") or f"resolve {var} " in line, line


def test_an_invalid_config_file_names_the_file(tmp_path: Path) -> None:
    config = tmp_path / "nt.json"
    config.write_text("{oops")
    line = start_error(tmp_path, "--config", str(config))
    assert line.startswith(f"config file {config} is not valid JSON")


def test_a_bad_base_for_a_client_command(tmp_path: Path) -> None:
    result = run_cli("tasks", "list", "--base", "nonsense", home=tmp_path)
    assert result.returncode == 1
    assert one_line(result) == "--base must be an http:// or https:// URL, got 'nonsense'"


def test_a_server_that_is_not_reachable(tmp_path: Path) -> None:
    port = free_port()
    started = time.monotonic()
    result = run_cli("tasks", "list", "--base", f"http://127.0.0.1:{port}", home=tmp_path)
    assert result.returncode == 1
    line = one_line(result)
    assert line.startswith(f"cannot reach the server at http://127.0.0.1:{port}: "), line
    assert time.monotonic() - started < 30  # it gives up rather than retrying for ever


# --- logs --------------------------------------------------------------------------------------

ISO_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


def served_log(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> list[str]:
    """The log lines of a server that answered one request and stopped."""
    server = Server(tmp_path / "logs.db", args=list(args), env=env).start()
    try:
        client = server.client()
        assert client.get("/health").status == 200
        client.close()
    finally:
        assert server.stop() == 0
    return server.output().splitlines()


def test_json_logs_are_one_object_per_line_from_both_processes(tmp_path: Path) -> None:
    lines = served_log(tmp_path, "--log-format", "json", "--access-log")
    records = [json.loads(line) for line in lines]  # every line is JSON
    assert all(ISO_UTC.match(r["ts"]) and r["level"] and r["message"] for r in records)
    loggers = {r["logger"] for r in records}
    assert {"nulltickets", "_granian", "granian.access"} <= loggers
    # granian's worker process logs as _granian.serve ("Started worker-1"): its format is ours.
    assert "_granian.serve" in loggers
    access = [r for r in records if r["logger"] == "granian.access"]
    assert any('"GET /health HTTP/1.1" 200' in r["message"] for r in access)


def test_text_logs_start_with_a_timestamp_and_honour_the_level(tmp_path: Path) -> None:
    lines = served_log(tmp_path, env={"NULLTICKETS_LOG_LEVEL": "warning"})
    assert all(ISO_UTC.match(line) for line in lines), lines
    assert not [line for line in lines if " INFO " in line]  # warning and above only
    lines = served_log(tmp_path, "--log-format", "text")
    assert lines and all(ISO_UTC.match(line) for line in lines), lines
    assert any(" INFO nulltickets: " in line and "listening on" in line for line in lines)


def test_a_postgresql_database_nobody_serves_is_one_line(tmp_path: Path) -> None:
    """With the driver (the Python package with its `postgres` extra) the server says it cannot
    reach the database; without it (the release binaries) it says how to get it."""
    port = free_port()  # nothing listens there
    line = start_error(tmp_path, "--db", f"postgresql://nobody@127.0.0.1:{port}/tracker")
    if os.environ.get("NULLTICKETS_BINARY"):
        assert line.endswith("pip install 'nulltickets[postgres]'"), line
    else:
        assert f"127.0.0.1:{port}" in line or "tracker" in line, line
