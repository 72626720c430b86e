"""Play nullhub's part against the real command (contract §16): read the manifest the way
nullhub parses it, write the config with `--from-json`, launch the server with no flags from
the instance directory, and use it on the configured port and token."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.server import TIME_SCALE, Client, Server, free_port, server_command

pytestmark = [pytest.mark.e2e, pytest.mark.process]

STEP_TYPES = {"select", "multi_select", "secret", "text", "number", "toggle", "dynamic_select"}


def run(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*server_command(), *args],
        cwd=cwd,
        env={**clean_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=60 * TIME_SCALE,
    )


def clean_env() -> dict[str, str]:
    """The test's environment without anything that would point the command at a real home or
    override the configured port."""
    env = dict(os.environ)
    for name in ("NULLTICKETS_HOME", "NULLTICKETS_PORT", "NULLTICKETS_SERVE_SETTINGS"):
        env.pop(name, None)
    return env


# --- what nullhub's manifest parser (a strict Zig struct) requires ------------------------------


def is_str(v: Any) -> bool:
    return isinstance(v, str)


def is_int(v: Any, bits: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**bits


def check_manifest(m: Any) -> None:
    assert isinstance(m, dict)
    required = {
        "schema_version",
        "name",
        "display_name",
        "description",
        "icon",
        "repo",
        "platforms",
        "launch",
        "health",
        "ports",
        "wizard",
        "depends_on",
        "connects_to",
    }
    assert required <= set(m), required - set(m)
    assert is_int(m["schema_version"], 32) and m["schema_version"] == 1
    for key in ("name", "display_name", "description", "icon", "repo"):
        assert is_str(m[key]) and m[key], key
    assert m["name"] == "nulltickets"

    assert isinstance(m["platforms"], dict) and m["platforms"]
    for triple, entry in m["platforms"].items():
        assert is_str(triple)
        assert set(entry) == {"asset", "binary"} and all(map(is_str, entry.values())), entry

    launch = m["launch"]
    assert is_str(launch["command"]) and launch["command"]
    assert isinstance(launch.get("args", []), list) and all(map(is_str, launch.get("args", [])))
    # nullhub runs HTTP health checks only for these launch commands.
    assert launch["command"] in ("serve", "gateway")

    assert m["health"]["endpoint"] == "/health" and m["health"]["port_from_config"] == "port"
    assert isinstance(m["ports"], list) and m["ports"]
    for port in m["ports"]:
        assert set(port) == {"name", "config_key", "default", "protocol"}, port
        assert is_str(port["name"]) and is_str(port["config_key"]) and is_str(port["protocol"])
        assert is_int(port["default"], 16)
    assert m["ports"][0] == {
        "name": "api",
        "config_key": "port",
        "default": 7700,
        "protocol": "http",
    }

    steps = m["wizard"]["steps"]
    assert isinstance(steps, list)
    for step in steps:
        assert is_str(step["id"]) and is_str(step["title"]) and step["type"] in STEP_TYPES
        assert isinstance(step.get("required", True), bool)
        for key in ("description", "default_value"):
            assert is_str(step.get(key, "")), (step["id"], key)
        for option in step.get("options", []):
            assert is_str(option["value"]) and is_str(option["label"])
    by_id = {s["id"]: s for s in steps}
    assert (by_id["port"]["type"], by_id["port"]["required"]) == ("number", True)
    assert (by_id["api_token"]["type"], by_id["api_token"]["required"]) == ("secret", False)
    assert by_id["api_token"]["description"]
    assert (by_id["db_path"]["type"], by_id["db_path"]["required"]) == ("text", True)
    assert by_id["db_path"]["default_value"] == "nulltickets.db"

    assert m["depends_on"] == [] and m["connects_to"] == []


def test_export_manifest_is_what_nullhub_parses_and_touches_nothing(tmp_path: Path) -> None:
    r = run("--export-manifest", cwd=tmp_path, env={"HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.endswith("\n")
    check_manifest(json.loads(r.stdout))
    assert list(tmp_path.iterdir()) == []  # no database, no config


def test_from_json_errors_exit_1_with_one_line(tmp_path: Path) -> None:
    for args in (["--from-json"], ["--from-json", "not json"], ["--from-json", '{"port": 99999}']):
        r = run(*args, cwd=tmp_path, env={"NULLTICKETS_HOME": str(tmp_path / "h")})
        assert r.returncode == 1, args
        assert r.stderr.count("\n") == 1 and r.stderr.startswith("nulltickets: "), r.stderr
    assert not (tmp_path / "h" / "config.json").exists()


def test_invalid_config_file_exits_1(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"port": "x"}')
    r = run("nulltickets", cwd=tmp_path, env={"NULLTICKETS_HOME": str(tmp_path)})
    assert r.returncode == 1
    assert "config.json" in r.stderr and "'port'" in r.stderr


# --- install and launch -------------------------------------------------------------------------


class NullhubInstance(Server):
    """The server as nullhub starts it: `<bin> <word>` and nothing else, with NULLTICKETS_HOME
    and the working directory set to the instance directory; the port comes from config.json."""

    def __init__(self, instance: Path, word: str, port: int) -> None:
        super().__init__(
            instance.parent / f"{word}.db", cwd=instance, env={"NULLTICKETS_HOME": str(instance)}
        )
        self.port = port
        self.word = word

    def command(self) -> list[str]:
        return [*server_command(), self.word]

    def start(self, timeout: float = 20.0 * TIME_SCALE) -> NullhubInstance:
        env = {**clean_env(), **(self.env or {})}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.cwd
            )
        self.wait_healthy(timeout)
        return self


def health_check_ms(port: int) -> tuple[int, float]:
    """nullhub's health check: a fresh connection, one GET, read the status line."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(
            f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode()
        )
        head = s.recv(1024)
    elapsed = (time.monotonic() - start) * 1000
    return int(head.split(b" ")[1]), elapsed


def exported_launch_command(tmp_path: Path) -> str:
    r = run("--export-manifest", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    return str(json.loads(r.stdout)["launch"]["command"])


@pytest.mark.parametrize("launch", ["nulltickets", "manifest"])
def test_install_with_wizard_answers_then_launch_like_nullhub(launch: str, tmp_path: Path) -> None:
    instance = tmp_path / "instances" / "nulltickets" / "default"
    instance.mkdir(parents=True)
    word = exported_launch_command(tmp_path) if launch == "manifest" else launch
    port, token = free_port(), "hub-secret"

    # nullhub injects "home" and passes the wizard's answers through, numbers as strings.
    answers = {
        "home": str(instance),
        "port": str(port),
        "api_token": token,
        "db_path": "data/tickets.db",
        "instance_name": "default",
        "version": "latest",
        "gateway_port": 3000,
        "gateway": {"port": 3000},
    }
    done = run("--from-json", json.dumps(answers), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == '{"status":"ok"}\n'
    config = json.loads((instance / "config.json").read_text())
    assert config == {"port": port, "db": "data/tickets.db", "api_token": token}

    server = NullhubInstance(instance, word, port)
    try:
        server.start()
        for _ in range(5):
            status, ms = health_check_ms(port)
            assert status == 200
            assert ms < 750, f"/health took {ms:.0f} ms"

        anonymous = Client("127.0.0.1", port)
        client = Client("127.0.0.1", port, token=token)
        try:
            health = anonymous.get("/health")
            assert health.status == 200 and health.json["status"] == "ok"

            assert anonymous.get("/pipelines").status == 401
            assert client.get("/pipelines", token="wrong").status == 401
            r = client.get("/pipelines")
            assert r.status == 200, r.body
            assert isinstance(r.json, list)

            r = client.get("/ops/queue")
            assert r.status == 200, r.body
            assert isinstance(r.json["roles"], list)

            r = client.put("/store/hub/greeting", {"value": {"text": "hello", "n": 1}})
            assert r.status == 204, r.body
            r = client.get("/store/hub/greeting")
            assert r.status == 200, r.body
            assert r.json["value"] == {"text": "hello", "n": 1}
            assert anonymous.get("/store/hub/greeting").status == 401
        finally:
            anonymous.close()
            client.close()
    finally:
        server.stop()

    # The relative db of config.json lives in the instance directory.
    assert (instance / "data" / "tickets.db").exists()
    assert not (instance / "nulltickets.db").exists()


def test_without_config_file_the_database_is_in_the_working_directory(tmp_path: Path) -> None:
    """`make run` and the tests pass no --db: with no config file the database is
    ./nulltickets.db, as before config files existed."""
    home, work = tmp_path / "empty-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()

    class Plain(Server):
        def command(self) -> list[str]:
            return [*server_command(), "serve", "--port", str(self.port)]

    server = Plain(tmp_path / "plain.db", cwd=work, env={"NULLTICKETS_HOME": str(home)})
    try:
        server.start()
        c = server.client()
        try:
            assert c.get("/pipelines").status == 200  # no config, no token: no auth
        finally:
            c.close()
    finally:
        server.stop()
    assert (work / "nulltickets.db").exists()
    assert list(home.iterdir()) == []
