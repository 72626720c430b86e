"""The worker's command line and how it words an attempt's end, without running anything."""

from __future__ import annotations

import argparse
import sys

import pytest

from nulltickets.worker import _exit_reason, add_arguments, build_parser, main_from_args

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
