"""Every setting from flags, the config file and its environment variable (flags > file > env >
defaults); the command tree's help; the log formats. Temp dirs only, no server."""

from __future__ import annotations

import argparse
import json
import logging
import logging.config
import re
from pathlib import Path
from typing import Any

import pytest

from nulltickets import cli, logs
from nulltickets.config import (
    SETTINGS,
    ConfigError,
    Flags,
    Settings,
    build_settings,
    database_path,
)

# setting -> (a flag value, the value a file holds, the environment's text, what env means)
CASES: dict[str, tuple[Any, Any, str, Any]] = {
    "db": ("flag.db", "file.db", "env.db", "env.db"),
    "host": ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.4"),
    "port": (8001, 8002, "8003", 8003),
    "token": ("flag-t", "file-t", "env-t", "env-t"),
    "max_body_bytes": (4096, 8192, "16384", 16384),
    "durability": ("full", "normal", "normal", "normal"),
    "body_timeout_s": (5.0, 6.0, "7.5", 7.5),
    "access_log": (True, False, "yes", True),
    "log_format": ("text", "json", "json", "json"),
    "log_level": ("debug", "warning", "error", "error"),
    "allowed_origins": (
        ("http://flag.example",),
        ["http://file.example"],
        "http://env.example, HTTPS://Env2.example:443/",
        ("http://env.example", "https://env2.example"),
    ),
    "allowed_hosts": (
        ("flag.example",),
        ["file.example"],
        "Env.example.,::1",
        ("env.example", "[::1]"),
    ),
    "max_waiters": (100, 200, "300", 300),
    "max_streams": (10, 0, "30", 30),
    "retention_s": (3600.0, "2d", "12h", 43200.0),
    "prune_interval_s": (5.0, 10, "1m30s", 90.0),
    "retention_export": ("flag.jsonl", "file.jsonl", "env.jsonl", "env.jsonl"),
}
FLAG_FIELD = {"body_timeout_s": "read_timeout_s"}
# What a file value (a JSON list) becomes.
FROM_FILE = {
    "allowed_origins": ("http://file.example",),
    "allowed_hosts": ("file.example",),
    "retention_s": 2 * 86400.0,
}


def write(path: Path, doc: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


def test_the_table_covers_every_setting_a_person_sets() -> None:
    assert {row[0] for row in SETTINGS} == set(CASES)
    assert all(row[3].startswith("NULLTICKETS_") for row in SETTINGS)


@pytest.mark.parametrize(("setting", "flag", "key", "var"), SETTINGS, ids=lambda v: str(v))
def test_flag_beats_file_beats_environment_beats_default(
    setting: str, flag: str, key: str, var: str, tmp_path: Path
) -> None:
    flag_value, file_value, env_text, env_value = CASES[setting]
    home = tmp_path / "home"
    env = {"NULLTICKETS_HOME": str(home)}
    default = getattr(Settings(), setting)
    assert getattr(build_settings(Flags(), env), setting) == default
    env[var] = env_text
    assert getattr(build_settings(Flags(), env), setting) == env_value
    write(home / "config.json", {key: file_value})
    from_file = getattr(build_settings(Flags(), env), setting)
    assert from_file == (
        str(home / file_value)
        if setting in ("db", "retention_export")
        else FROM_FILE.get(setting, file_value)
    )
    flags = Flags(**{FLAG_FIELD.get(setting, setting): flag_value})
    assert getattr(build_settings(flags, env), setting) == flag_value


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("NULLTICKETS_PORT", "http"),
        ("NULLTICKETS_MAX_BODY_BYTES", "big"),
        ("NULLTICKETS_DURABILITY", "fast"),
        ("NULLTICKETS_READ_TIMEOUT", "soon"),
        ("NULLTICKETS_READ_TIMEOUT", "nan"),
        ("NULLTICKETS_ACCESS_LOG", "maybe"),
        ("NULLTICKETS_LOG_FORMAT", "xml"),
        ("NULLTICKETS_LOG_LEVEL", "loud"),
        ("NULLTICKETS_ALLOWED_ORIGINS", "evil.example"),
        ("NULLTICKETS_ALLOWED_ORIGINS", "ftp://evil.example"),
        ("NULLTICKETS_ALLOWED_ORIGINS", "http://evil.example/path"),
        ("NULLTICKETS_ALLOWED_ORIGINS", "null"),
        ("NULLTICKETS_ALLOWED_ORIGINS", "*"),
        ("NULLTICKETS_ALLOWED_ORIGINS", "http://evil.example:99999"),
        ("NULLTICKETS_ALLOWED_HOSTS", "evil.example:8080"),
        ("NULLTICKETS_ALLOWED_HOSTS", "http://evil.example"),
        ("NULLTICKETS_ALLOWED_HOSTS", "*"),
        ("NULLTICKETS_MAX_WAITERS", "many"),
        ("NULLTICKETS_MAX_STREAMS", "-1"),
        ("NULLTICKETS_RETENTION", "forever"),
        ("NULLTICKETS_RETENTION", "0.0s"),
        ("NULLTICKETS_PRUNE_INTERVAL", "0s"),
        ("NULLTICKETS_PRUNE_INTERVAL", "off"),
    ],
)
def test_a_bad_variable_is_an_error_naming_it(var: str, value: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=var):
        build_settings(Flags(), {"NULLTICKETS_HOME": str(tmp_path), var: value})


def test_retention_is_a_month_by_default_and_off_from_any_source(tmp_path: Path) -> None:
    env = {"NULLTICKETS_HOME": str(tmp_path / "home")}
    assert build_settings(Flags(), env).retention_s == 30 * 86400.0
    assert build_settings(Flags(), {**env, "NULLTICKETS_RETENTION": "off"}).retention_s is None
    write(tmp_path / "home" / "config.json", {"retention": "off"})
    assert build_settings(Flags(), env).retention_s is None
    # A flag beats the file's "off", and "off" on the command line beats the file's duration.
    assert build_settings(Flags(retention_s=60.0), env).retention_s == 60.0
    write(tmp_path / "home" / "config.json", {"retention": "7d"})
    assert build_settings(Flags(retention_s=0.0), env).retention_s is None
    assert build_settings(Flags(), env).retention_s == 7 * 86400.0


def test_a_bad_retention_in_the_config_file_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path / "home" / "config.json", {"retention": [1]})
    with pytest.raises(ConfigError, match="'retention'"):
        build_settings(Flags(config=str(path)), {})


def test_an_empty_variable_counts_as_unset(tmp_path: Path) -> None:
    env = {"NULLTICKETS_HOME": str(tmp_path), "NULLTICKETS_PORT": "", "NULLTICKETS_TOKEN": ""}
    assert build_settings(Flags(), env) == Settings()


def test_nulltickets_db_beats_the_default_next_to_a_config_file(tmp_path: Path) -> None:
    home = tmp_path / "home"
    write(home / "config.json", {"port": 8010})
    env = {"NULLTICKETS_HOME": str(home)}
    assert database_path(env=env) == str(home / "nulltickets.db")
    env["NULLTICKETS_DB"] = "from-env.db"
    assert database_path(env=env) == "from-env.db" == build_settings(Flags(), env).db
    assert database_path(db="flag.db", env=env) == "flag.db"


def test_an_empty_api_token_in_the_file_wins_over_nulltickets_token(tmp_path: Path) -> None:
    write(tmp_path / "config.json", {"api_token": ""})
    env = {"NULLTICKETS_HOME": str(tmp_path), "NULLTICKETS_TOKEN": "env"}
    assert build_settings(Flags(), env).token is None


def test_allowed_origins_and_hosts_in_a_file_may_be_one_comma_separated_string(
    tmp_path: Path,
) -> None:
    write(
        tmp_path / "config.json",
        {"allowed_origins": "http://a.example:80, https://b.example", "allowed_hosts": "a,B"},
    )
    settings = build_settings(Flags(), {"NULLTICKETS_HOME": str(tmp_path)})
    assert settings.allowed_origins == ("http://a.example", "https://b.example")
    assert settings.allowed_hosts == ("a", "b")
    write(tmp_path / "config.json", {"allowed_hosts": [1]})
    with pytest.raises(ConfigError, match="'allowed_hosts' must be a list of strings"):
        build_settings(Flags(), {"NULLTICKETS_HOME": str(tmp_path)})


def test_config_flag_naming_a_missing_file_is_an_error(tmp_path: Path) -> None:
    missing = tmp_path / "absent.json"
    with pytest.raises(ConfigError, match=f"config file {re.escape(str(missing))} does not"):
        build_settings(Flags(config=str(missing)), {})
    with pytest.raises(ConfigError, match="does not exist"):
        database_path(config=str(missing), env={})


def test_settings_reach_the_server_worker_through_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = Settings(log_format="json", log_level="debug", access_log=True, port=0)
    monkeypatch.setenv("NULLTICKETS_SERVE_SETTINGS", settings.to_env())
    assert Settings.from_env() == settings


# --- the command line --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-body-bytes", "abc"], "--max-body-bytes must be a whole number"),
        (["--durability", "fast"], "--durability must be one of full, normal"),
        (["--read-timeout", "x"], "--read-timeout must be a number of seconds"),
        (["--log-format", "xml"], "--log-format must be one of text, json"),
        (["--log-level", "loud"], "--log-level must be one of debug"),
        (["--host", ""], "--host must not be empty"),
        (["--port", "7o7"], "--port must be a port number"),
        (["--allowed-origins", "evil.example"], "--allowed-origins must list origins"),
        (["--allowed-hosts", "a b"], "--allowed-hosts must list host names"),
        (["--max-waiters", "lots"], "--max-waiters must be a whole number"),
        (["--max-streams", "-5"], "--max-streams must be a whole number"),
    ],
)
def test_a_bad_flag_value_is_one_line_and_status_1(
    argv: list[str],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("NULLTICKETS_HOME", str(tmp_path))
    assert cli.main(["serve", *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"nulltickets: {message}") and err.count("\n") == 1


def walk(parser: argparse.ArgumentParser, name: str = "nulltickets") -> list[tuple[str, Any]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for word, sub in action.choices.items():
                if word in helps or sub.prog.endswith(word):
                    found.append((f"{name} {word}", helps.get(word, sub.description)))
                    found.extend(walk(sub, f"{name} {word}"))
        else:
            found.append((f"{name} {'/'.join(action.option_strings) or action.dest}", action.help))
    return found


def test_every_command_and_flag_has_a_help_text() -> None:
    entries = walk(cli._parser())
    missing = [name for name, text in entries if not text]
    assert not missing, missing
    names = {name for name, _ in entries}
    for command in [
        "serve",
        "worker",
        "checkpoint",
        "event",
        "pause",
        "tasks list",
        "tasks show",
        "tasks requeue",
        "tasks cancel",
        "runs tail",
        "backup",
        "doctor",
    ]:
        assert f"nulltickets {command}" in names, command


@pytest.mark.parametrize("command", [["worker"], ["tasks", "list"], ["doctor"], ["runs", "tail"]])
def test_subcommand_help_exits_0(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main([*command, "--help"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: nulltickets {' '.join(command)}")


def test_worker_without_a_command_is_a_usage_error_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["worker", "--role", "coder"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nulltickets worker: give the command after --") and err.count("\n") == 1


def test_worker_takes_the_command_after_the_separator() -> None:
    args = cli._parser().parse_args(["worker", "--role", "r", "--", "./a.sh", "-x", "--y"])
    assert (args.role, args.worker_command) == ("r", ["./a.sh", "-x", "--y"])


def test_empty_agent_id_is_one_line_and_status_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["pause", "--agent-id", " "]) == 1
    assert capsys.readouterr().err == "nulltickets: --agent-id must not be empty\n"


@pytest.mark.parametrize(
    ("base", "message"),
    [
        ("nonsense", "--base must be an http:// or https:// URL, got 'nonsense'"),
        ("ftp://host", "--base must be an http:// or https:// URL"),
        ("http://host:port", "--base is not a URL"),
    ],
)
def test_a_bad_base_is_one_line_and_status_1(
    base: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["tasks", "list", "--base", base]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"nulltickets: {message}") and err.count("\n") == 1


def test_a_bad_base_url_variable_is_named(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NULLTICKETS_BASE_URL", "nonsense")
    assert cli.main(["tasks", "show", "x"]) == 1
    assert capsys.readouterr().err.startswith("nulltickets: NULLTICKETS_BASE_URL must be")


# --- logs --------------------------------------------------------------------------------------

ISO_UTC = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"


def record(message: str = "hello %s", *args: object) -> logging.LogRecord:
    return logging.LogRecord("nulltickets.x", logging.WARNING, __file__, 1, message, args, None)


def test_text_lines_start_with_an_iso_utc_timestamp() -> None:
    line = logs.TextFormatter().format(record("hello %s", "world"))
    assert re.fullmatch(ISO_UTC + r" WARNING nulltickets\.x: hello world", line), line


def test_json_lines_carry_the_timestamp_level_logger_and_message() -> None:
    doc = json.loads(logs.JsonFormatter().format(record("hello %s", "world")))
    assert set(doc) == {"ts", "level", "logger", "message"}
    assert re.fullmatch(ISO_UTC, doc["ts"])
    assert (doc["level"], doc["logger"], doc["message"]) == (
        "warning",
        "nulltickets.x",
        "hello world",
    )


def test_timestamps_are_utc() -> None:
    assert logs.timestamp(0.25) == "1970-01-01T00:00:00.250Z"


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_the_dictconfig_configures_our_loggers_and_granians(fmt: str) -> None:
    config = logs.dictconfig(fmt, "warning")
    assert set(config["loggers"]) >= {"nulltickets", *logs.GRANIAN_LOGGERS}
    try:
        logging.config.dictConfig(config)
        handler = logging.getLogger("_granian").handlers[0]
        assert isinstance(handler.formatter, logs.FORMATTERS[fmt])
        assert logging.getLogger("nulltickets").level == logging.WARNING
    finally:
        logging.config.dictConfig({"version": 1, "disable_existing_loggers": False})
