"""The worker's command line and how it words an attempt's end, without running anything."""

from __future__ import annotations

import argparse
import sys

import pytest

from nulltickets.config import ConfigError, parse_duration
from nulltickets.worker import (
    _exit_reason,
    add_arguments,
    build_parser,
    command_env,
    main_from_args,
)

PY = sys.executable


def test_an_exit_is_told_by_status_or_signal() -> None:
    assert _exit_reason(7) == "command exited with status 7"
    assert _exit_reason(-9) == "command was killed by signal 9 (SIGKILL)"
    assert _exit_reason(-15) == "command was killed by signal 15 (SIGTERM)"


def test_the_flags_fit_under_a_subcommand_and_keep_the_command_whole() -> None:
    parser = argparse.ArgumentParser(prog="nulltickets")
    sub = parser.add_subparsers(dest="command", required=True)
    add_arguments(sub.add_parser("worker"))
    args = parser.parse_args(["worker", "--role", "r", "--once", "--", "sh", "-c", "x --role"])
    assert args.command == "worker" and args.role == "r" and args.once
    assert args.worker_command == ["sh", "-c", "x --role"]


def test_every_flag_has_a_help_text() -> None:
    for action in build_parser()._actions:
        assert action.help, action.dest


def test_the_environment_gives_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NULLTICKETS_BASE_URL", "https://tracker.example:8443")
    monkeypatch.setenv("NULLTICKETS_TOKEN", "secret")
    args = build_parser().parse_args(["--role", "r", "--", sys.executable])
    assert (args.base, args.token) == ("https://tracker.example:8443", "secret")
    flags = build_parser().parse_args(["--role", "r", "--base", "http://h:1", "--", sys.executable])
    assert flags.base == "http://h:1"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--role", "r"], "give the command after --"),
        (["--role", "r", "--", "no-such-command-here"], "command not found: no-such-command-here"),
        (
            ["--role", "r", "--base", "localhost:7700", "--", sys.executable],
            "--base: base URL must be",
        ),
        (
            ["--role", "r", "--wait-ms", "-1", "--", sys.executable],
            "--wait-ms must not be negative",
        ),
    ],
)
def test_bad_flags_are_one_line_and_status_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main_from_args(build_parser().parse_args(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"nulltickets worker: {message}") and err.count("\n") == 1


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30s", 30.0),
        ("5m", 300.0),
        ("1h", 3600.0),
        ("1h30m", 5400.0),
        ("250ms", 0.25),
        ("1.5h", 5400.0),
        ("90", 90.0),
        (" 2M ", 120.0),
    ],
)
def test_a_duration_is_read_in_seconds(text: str, seconds: float) -> None:
    assert parse_duration(text, "--timeout") == seconds


@pytest.mark.parametrize("text", ["", "s", "5 m", "5d", "-5s", "1h-30m", "m5", "inf", "nan"])
def test_a_bad_duration_says_what_is_expected(text: str) -> None:
    with pytest.raises(ConfigError, match="--timeout must be a duration like 30s, 5m or 1h"):
        parse_duration(text, "--timeout")


def test_a_timeout_that_is_not_a_positive_duration_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for value, message in (("soon", "--timeout must be a duration"), ("0s", "must be positive")):
        argv = ["--role", "r", "--timeout", value, "--", sys.executable]
        assert main_from_args(build_parser().parse_args(argv)) == 2
        assert message in capsys.readouterr().err


def test_the_command_gets_no_variable_of_the_worker_and_none_holding_its_token() -> None:
    token = "a-worker-token-of-some-length"
    inherited = {
        "PATH": "/usr/bin",
        "HOME": "/home/a",
        "ANTHROPIC_API_KEY": "the agent's own key",
        "NULLTICKETS_TOKEN": token,
        "NULLTICKETS_DB": "postgresql://u:pw@db/tracker",
        "nulltickets_key": "k",
        "MY_TRACKER_TOKEN": token,
        "AUTH": f"Bearer {token}",
    }
    env = command_env(inherited, [token], {"NULLTICKETS_RUN_ID": "r1"})
    assert env == {
        "PATH": "/usr/bin",
        "HOME": "/home/a",
        "ANTHROPIC_API_KEY": "the agent's own key",
        "NULLTICKETS_RUN_ID": "r1",
    }


def test_a_short_token_is_only_stripped_where_it_is_the_whole_value() -> None:
    env = command_env({"PATH": "/usr/bin:/bin", "T": "bin"}, ["bin"], {})
    assert env == {"PATH": "/usr/bin:/bin"}
