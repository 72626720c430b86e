"""The `nulltickets` command: parse the command line, then hand over. No logic of its own.

    nulltickets [serve|gateway|nulltickets] [flags]     run the server (cli/serve.py, §16.1)
    nulltickets worker | checkpoint | event | pause     the agent side (cli/agent.py)
    nulltickets tasks ... | runs tail                   against a running server (cli/admin.py)
    nulltickets backup | doctor | prune                 on the database (cli/db.py)
    nulltickets --export-manifest                       print nullhub's manifest (§16.4)
    nulltickets --from-json '<json>'                    write config.json from wizard answers

nullhub runs `<bin> <word>` with only NULLTICKETS_HOME set, so the launch words and no word at
all start the server. Any other unknown word or flag is an error: status 2 and the usage on
stderr. A bad value, a failed start-up or a failed command is one line on stderr, status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from nulltickets.cli import admin, agent, db, migrate, serve
from nulltickets.client.remote import CommandFailed
from nulltickets.config import ENV_DB, ConfigError, write_wizard_config
from nulltickets.errors import TrackerError

# What may come first without a command word (anything else starting with "-" is serve's).
TOP_LEVEL = ("-h", "--help", "--version", "--export-manifest", "--from-json")

EPILOG = (
    """Without a command (or with serve, gateway or nulltickets) the server starts.
`nulltickets COMMAND --help` describes each command.

--export-manifest and --from-json count only as the first argument.

"""
    + serve.CONFIGURATION
)


class _Parser(argparse.ArgumentParser):
    """A usage error names the argument it did not expect, never a password inside it."""

    def error(self, message: str) -> NoReturn:
        from nulltickets import logs

        super().error(logs.scrub(message))


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="nulltickets",
        description="Durable task state for AI agents, served over a JSON HTTP API.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--version", action="store_true", help="print the version and exit")
    p.add_argument(
        "--export-manifest", action="store_true", help="print nullhub's manifest JSON and exit"
    )
    p.add_argument(
        "--from-json",
        metavar="JSON",
        help="write <home>/config.json from nullhub's wizard answers and exit",
    )
    commands = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Subparser)
    serve.register(commands)
    agent.register(commands)
    admin.register(commands)
    db.register(commands)
    migrate.register(commands)
    return p


class _Subparser(_Parser):
    """Subcommands refuse abbreviated flags too (`--po` is not `--port`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def export_manifest() -> int:
    from nulltickets.cli.manifest import manifest

    print(json.dumps(manifest(), indent=2))
    return 0


def from_json(rest: Sequence[str]) -> int:
    if not rest:
        print("nulltickets: --from-json needs a JSON argument", file=sys.stderr)
        return 1
    try:
        write_wizard_config(rest[0])
    except ConfigError as exc:
        print(f"nulltickets: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"status": "ok"}, separators=(",", ":")))
    return 0


def normalise(argv: Sequence[str]) -> list[str]:
    """No command word means serve: `nulltickets` and `nulltickets --port 1` start it."""
    args = list(argv)
    if not args or (args[0].startswith("-") and args[0] not in TOP_LEVEL):
        return ["serve", *args]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    # A database URL's password, wherever the command line or the environment holds one, is
    # never shown: not in a log record, an error line or a usage message.
    hide_passwords(*args_in, os.environ.get(ENV_DB, ""))
    # Both modes count only as the first argument, like the original's.
    if args_in[:1] == ["--export-manifest"]:
        return export_manifest()
    if args_in[:1] == ["--from-json"]:
        return from_json(args_in[1:])
    parser = _parser()
    args = parser.parse_args(normalise(args_in))  # usage errors exit 2 with the usage
    if args.command is None:
        if args.version:
            from nulltickets.server.launch import version_line

            print(version_line())
            return 0
        parser.error("--export-manifest and --from-json must come first")
    # Every command, not only serve: a worker the onefile bootstrap leaves behind would run on
    # as an orphan once its supervisor SIGKILLs the binary's pid.
    from nulltickets.lifetime import follow_onefile_parent

    follow_onefile_parent()
    try:
        status: int = args.func(args)
    except CommandFailed as exc:
        return _failed(str(exc), exc.status)
    except ConfigError as exc:
        return _failed(str(exc))
    except TrackerError as exc:
        return _failed(exc.message)
    except KeyboardInterrupt:
        return 130
    except OSError as exc:  # a start-up step the checks above did not foresee
        return _failed(str(exc.strerror or exc))
    except Exception as exc:  # still one line, never a traceback, for whoever runs us
        return _failed(f"{type(exc).__name__}: {exc}")
    return status


def _failed(message: str, status: int = 1) -> int:
    from nulltickets import logs

    print(f"nulltickets: {logs.scrub(message)}", file=sys.stderr)
    return status


def hide_passwords(*targets: str) -> None:
    """Have the logs and error lines of this process never show these targets' passwords."""
    from nulltickets import logs
    from nulltickets.storage.dsn import secrets_of

    for target in targets:
        logs.hide(*secrets_of(target))
