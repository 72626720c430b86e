"""Settings from flags, the config file and the environment; the wizard's config file; the
manifest; the command line's exits (contract §16). Temp dirs only, no server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nulltickets import __version__, cli, core
from nulltickets.cli import serve
from nulltickets.cli.manifest import manifest
from nulltickets.config import (
    ConfigError,
    Flags,
    Settings,
    build_settings,
    config_path,
    home_dir,
    read_config,
    write_wizard_config,
)


def write(path: Path, doc: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


@pytest.fixture
def env(home: Path) -> dict[str, str]:
    return {"NULLTICKETS_HOME": str(home)}


# --- locating the file -------------------------------------------------------------------------


def test_home_is_nulltickets_home_then_home_dot_nulltickets_then_userprofile() -> None:
    assert home_dir({"NULLTICKETS_HOME": "/a", "HOME": "/h"}) == Path("/a")
    assert home_dir({"HOME": "/h"}) == Path("/h/.nulltickets")
    assert home_dir({"USERPROFILE": "C:/Users/x"}) == Path("C:/Users/x/.nulltickets")
    assert home_dir({"NULLTICKETS_HOME": "", "HOME": "/h"}) == Path("/h/.nulltickets")
    assert home_dir({}) is None


def test_config_flag_wins_over_home() -> None:
    assert config_path("/etc/nt.json", {"NULLTICKETS_HOME": "/a"}) == Path("/etc/nt.json")
    assert config_path(None, {"NULLTICKETS_HOME": "/a"}) == Path("/a/config.json")
    assert config_path(None, {}) is None


# --- defaults and precedence -------------------------------------------------------------------


def test_no_config_file_gives_defaults_with_db_in_working_directory(env: dict[str, str]) -> None:
    assert build_settings(Flags(), env) == Settings()
    assert Settings().db == "nulltickets.db"
    assert build_settings(Flags(), {}) == Settings()  # no home at all: still defaults


def test_config_file_values_are_used(home: Path, env: dict[str, str]) -> None:
    write(
        home / "config.json",
        {
            "port": 8123,
            "db": "/var/nt.db",
            "api_token": "tok",
            "host": "0.0.0.0",
            "durability": "full",
            "max_body_bytes": 2048,
        },
    )
    s = build_settings(Flags(), env)
    assert (s.port, s.db, s.token, s.host, s.durability, s.max_body_bytes) == (
        8123,
        "/var/nt.db",
        "tok",
        "0.0.0.0",
        "full",
        2048,
    )


def test_flags_win_over_config_file(home: Path, env: dict[str, str]) -> None:
    write(home / "config.json", {"port": 8123, "db": "a.db", "api_token": "tok"})
    s = build_settings(Flags(port=9000, db="b.db", token="flag", durability="full"), env)
    assert (s.port, s.db, s.token, s.durability) == (9000, "b.db", "flag", "full")


def test_empty_token_flag_switches_auth_off_over_config(home: Path, env: dict[str, str]) -> None:
    write(home / "config.json", {"api_token": "tok"})
    assert build_settings(Flags(token=""), env).token is None


@pytest.mark.parametrize("token", ["", None])
def test_empty_or_null_api_token_means_no_auth(
    token: str | None, home: Path, env: dict[str, str]
) -> None:
    write(home / "config.json", {"api_token": token})
    assert build_settings(Flags(), env).token is None


def test_unknown_keys_are_ignored(home: Path, env: dict[str, str]) -> None:
    write(home / "config.json", {"port": 8124, "gateway": {"x": 1}, "version": "9"})
    assert build_settings(Flags(), env).port == 8124


def test_nulltickets_port_is_below_config_and_flags(home: Path, env: dict[str, str]) -> None:
    env = {**env, "NULLTICKETS_PORT": "8200"}
    assert build_settings(Flags(), env).port == 8200
    write(home / "config.json", {"port": 8300})
    assert build_settings(Flags(), env).port == 8300
    assert build_settings(Flags(port=8400), env).port == 8400


def test_bad_nulltickets_port_is_an_error_only_when_it_decides(env: dict[str, str]) -> None:
    env = {**env, "NULLTICKETS_PORT": "http"}
    with pytest.raises(ConfigError, match="NULLTICKETS_PORT"):
        build_settings(Flags(), env)
    assert build_settings(Flags(port=8000), env).port == 8000


# --- db resolution -----------------------------------------------------------------------------


def test_relative_db_is_resolved_against_the_config_file_directory(
    home: Path, env: dict[str, str]
) -> None:
    write(home / "config.json", {"db": "data/t.db"})
    assert build_settings(Flags(), env).db == str(home / "data" / "t.db")


def test_default_db_lives_next_to_an_existing_config_file(home: Path, env: dict[str, str]) -> None:
    write(home / "config.json", {"port": 8125})
    assert build_settings(Flags(), env).db == str(home / "nulltickets.db")


def test_db_flag_is_used_verbatim(home: Path, env: dict[str, str]) -> None:
    write(home / "config.json", {"db": "data/t.db"})
    assert build_settings(Flags(db="rel.db"), env).db == "rel.db"


def test_explicit_config_path_anchors_db_to_its_own_directory(
    tmp_path: Path, env: dict[str, str]
) -> None:
    cfg = write(tmp_path / "elsewhere" / "nt.json", {"db": "x.db"})
    assert build_settings(Flags(config=str(cfg)), env).db == str(tmp_path / "elsewhere" / "x.db")


@pytest.mark.parametrize(
    "db",
    [":memory:", "file:t.db?mode=memory", "postgresql://u:pw@h/db", "postgres://h:5433/db"],
)
def test_sqlite_special_names_and_postgresql_urls_stay_as_written(
    db: str, home: Path, env: dict[str, str]
) -> None:
    write(home / "config.json", {"db": db})
    assert build_settings(Flags(), env).db == db


def test_relative_config_home_still_gives_an_absolute_db(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "inst" / "config.json", {"port": 8126})
    db = build_settings(Flags(), {"NULLTICKETS_HOME": "inst"}).db
    assert db == str(tmp_path / "inst" / "nulltickets.db")


# --- invalid files -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ({"port": "7700"}, "'port' must be an integer"),
        ({"port": True}, "'port' must be an integer"),
        ({"port": 70000}, "0..65535"),
        ({"port": -1}, "0..65535"),
        ({"db": 5}, "'db' must be a string"),
        ({"db": ""}, "'db' must not be empty"),
        ({"api_token": 5}, "'api_token' must be a string"),
        ({"durability": "fast"}, "'durability'"),
        ({"max_body_bytes": "big"}, "'max_body_bytes' must be an integer"),
        ("x" * (1024 * 1024 + 1), "larger than 1 MiB"),
    ],
)
def test_invalid_config_file_is_an_error_naming_the_file(
    content: Any, message: str, home: Path, env: dict[str, str]
) -> None:
    path = write(home / "config.json", content)
    with pytest.raises(ConfigError, match=message) as info:
        build_settings(Flags(), env)
    assert str(path) in str(info.value)


def test_unreadable_config_is_an_error(home: Path) -> None:
    (home / "config.json").mkdir(parents=True)  # a directory cannot be read as a file
    with pytest.raises(ConfigError, match="cannot read config file"):
        read_config(home / "config.json")


def test_missing_config_file_is_not_an_error(tmp_path: Path) -> None:
    assert read_config(tmp_path / "absent.json") is None


# --- the command line --------------------------------------------------------------------------


def test_invalid_config_exits_1_with_one_line_on_stderr(
    home: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NULLTICKETS_HOME", str(home))
    write(home / "config.json", "{oops")
    assert cli.main(["serve"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("nulltickets: config file") and err.count("\n") == 1


@pytest.mark.parametrize("port", ["65536", "-1", "http", ""])
def test_bad_port_flag_exits_1(
    port: str, home: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NULLTICKETS_HOME", str(home))
    assert cli.main(["--port", port]) == 1
    assert "--port must be a port number 0..65535" in capsys.readouterr().err


def test_version_prints_version_line_on_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out == f"nulltickets v{__version__} (core: {core.IMPLEMENTATION})\n"


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--export-manifest" in out and "--from-json" in out and "--config" in out


@pytest.mark.parametrize("word", ["serve", "gateway", "nulltickets", None])
def test_serve_words_and_no_word_build_the_same_settings(
    word: str | None, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NULLTICKETS_HOME", str(home))
    argv = cli.normalise([*([word] if word else []), "--port", "8127"])
    args = cli._parser().parse_args(argv)
    assert args.func is serve.serve_command
    assert serve.settings_from_args(args).port == 8127


@pytest.mark.parametrize(
    "argv",
    [
        ["tasks-list"],
        ["serve", "--unknown", "x"],
        ["--unknown"],
        ["gateway", "extra"],
        ["--port"],  # a value flag without its value
        ["serve", "--po", "8000"],  # abbreviations are not accepted
        ["tasks"],
        ["tasks", "frob"],
        ["runs"],
    ],
)
def test_unknown_words_and_flags_exit_2_with_the_usage(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: nulltickets") and "error:" in err


def test_serve_flags_still_work(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NULLTICKETS_HOME", str(home))
    args = cli._parser().parse_args(
        [
            "serve",
            "--host",
            "127.0.0.2",
            "--port",
            "0",
            "--db",
            "d.db",
            "--token",
            "t",
            "--max-body-bytes",
            "4096",
            "--durability",
            "full",
            "--access-log",
        ]
    )
    assert serve.settings_from_args(args) == Settings(
        db="d.db",
        host="127.0.0.2",
        port=0,
        token="t",
        max_body_bytes=4096,
        durability="full",
        access_log=True,
    )


def test_non_loopback_host_without_token_is_refused(
    capsys: pytest.CaptureFixture[str], home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NULLTICKETS_HOME", str(home))
    assert cli.main(["--host", "0.0.0.0"]) == 1
    assert "refusing to listen on 0.0.0.0 without a token" in capsys.readouterr().err


# --- --from-json -------------------------------------------------------------------------------


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def test_wizard_answers_as_strings_become_an_integer_port(home: Path) -> None:
    raw = json.dumps(
        {
            "home": str(home),
            "port": "8130",
            "db_path": "data/t.db",
            "api_token": "s3cret",
            "instance_name": "a",
            "version": "latest",
            "gateway_port": 3000,
            "gateway": {"x": 1},
        }
    )
    path = write_wizard_config(raw, {})
    assert path == home / "config.json"
    assert (
        path.read_text() == '{\n  "port": 8130,\n  "db": "data/t.db",\n  "api_token": "s3cret"\n}\n'
    )


def test_wizard_defaults_and_no_token(home: Path) -> None:
    path = write_wizard_config(json.dumps({"home": str(home), "port": 8131}), {})
    assert read_json(path) == {"port": 8131, "db": "nulltickets.db"}
    path = write_wizard_config(json.dumps({"home": str(home), "port": "", "db_path": ""}), {})
    assert read_json(path) == {"port": 7700, "db": "nulltickets.db"}


def test_wizard_numeric_token_is_written_as_a_string(home: Path) -> None:
    path = write_wizard_config(json.dumps({"home": str(home), "api_token": 12345}), {})
    assert read_json(path)["api_token"] == "12345"


def test_wizard_home_falls_back_to_nulltickets_home(home: Path) -> None:
    path = write_wizard_config('{"port": 8132}', {"NULLTICKETS_HOME": str(home / "a" / "b")})
    assert path == home / "a" / "b" / "config.json"
    assert read_json(path)["port"] == 8132


def test_wizard_tolerates_nullhubs_trailing_comma_for_empty_answers(home: Path) -> None:
    path = write_wizard_config(f'{{"home":{json.dumps(str(home))},}}', {})
    assert read_json(path) == {"port": 7700, "db": "nulltickets.db"}


def test_wizard_config_is_then_read_back_by_serve(home: Path) -> None:
    write_wizard_config(json.dumps({"home": str(home), "port": "8133", "api_token": ""}), {})
    s = build_settings(Flags(), {"NULLTICKETS_HOME": str(home)})
    assert (s.port, s.db, s.token) == (8133, str(home / "nulltickets.db"), None)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("{nope", "invalid JSON"),
        ("[1]", "invalid JSON"),
        ('"x"', "invalid JSON"),
        ('{"port": 70000}', "port must be a port number"),
        ('{"port": "80a"}', "port must be a port number"),
        ('{"port": true}', "port must be a port number"),
        ('{"db_path": 5}', "db_path must be a string"),
        ('{"api_token": [1]}', "api_token must be a string"),
        ('{"home": 5}', "home must be a string"),
    ],
)
def test_bad_wizard_input_is_an_error(raw: str, message: str, home: Path) -> None:
    with pytest.raises(ConfigError, match=message):
        write_wizard_config(raw, {"NULLTICKETS_HOME": str(home)})
    assert not (home / "config.json").exists()


def test_wizard_without_any_home_is_an_error() -> None:
    with pytest.raises(ConfigError, match="no home directory"):
        write_wizard_config('{"port": 1}', {})


def test_from_json_command_prints_status_ok(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--from-json", json.dumps({"home": str(home)})]) == 0
    assert capsys.readouterr().out == '{"status":"ok"}\n'


def test_from_json_command_without_argument_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--from-json"]) == 1
    assert capsys.readouterr().err == "nulltickets: --from-json needs a JSON argument\n"


def test_from_json_command_with_bad_json_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--from-json", "{"]) == 1
    assert capsys.readouterr().err == "nulltickets: invalid JSON\n"


# --- --export-manifest -------------------------------------------------------------------------


def test_manifest_launches_serve_and_checks_health_on_the_config_port() -> None:
    m = manifest()
    assert m["launch"] == {"command": "serve", "args": []}
    assert m["health"] == {"endpoint": "/health", "port_from_config": "port"}
    assert m["ports"] == [
        {"name": "api", "config_key": "port", "default": 7700, "protocol": "http"}
    ]
    assert m["version"] == __version__


def test_manifest_wizard_steps() -> None:
    steps = {s["id"]: s for s in manifest()["wizard"]["steps"]}
    assert list(steps) == ["port", "api_token", "db_path"]
    assert (steps["port"]["type"], steps["port"]["required"]) == ("number", True)
    assert (steps["api_token"]["type"], steps["api_token"]["required"]) == ("secret", False)
    assert steps["api_token"]["description"]
    assert (steps["db_path"]["type"], steps["db_path"]["required"]) == ("text", True)
    assert steps["db_path"]["default_value"] == "nulltickets.db"
    assert all(s["options"] == [] for s in steps.values())


def test_manifest_platform_assets() -> None:
    platforms = manifest()["platforms"]
    assert platforms["x86_64-linux"] == {
        "asset": "nulltickets-linux-x86_64.bin",
        "binary": "nulltickets",
    }
    assert platforms["aarch64-macos"]["asset"] == "nulltickets-macos-aarch64.bin"
    assert platforms["riscv64-linux"]["asset"] == "nulltickets-linux-riscv64.bin"
    assert platforms["aarch64-windows"] == {
        "asset": "nulltickets-windows-aarch64.exe",
        "binary": "nulltickets.exe",
    }
    assert len(platforms) == 7


def test_export_manifest_prints_the_manifest(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--export-manifest"]) == 0
    assert json.loads(capsys.readouterr().out) == manifest()
