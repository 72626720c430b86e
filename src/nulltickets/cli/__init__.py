"""The `nulltickets` command: parse the command line, then hand over. No logic of its own.

    nulltickets [serve|gateway|nulltickets] [flags]     run the server (contract §16.1)
    nulltickets worker | checkpoint | event | pause     the agent side (cli/agent.py)
    nulltickets tasks ... | runs tail                   against a running server (cli/admin.py)
    nulltickets backup | doctor                         on the database file (cli/db.py)
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

from nulltickets.cli import admin, agent, db, migrate
from nulltickets.config import (
    DURABILITIES,
    ENV_ACCESS_LOG,
    ENV_ALLOWED_HOSTS,
    ENV_ALLOWED_ORIGINS,
    ENV_DB,
    ENV_DURABILITY,
    ENV_HOST,
    ENV_LOG_FORMAT,
    ENV_LOG_LEVEL,
    ENV_MAX_BODY,
    ENV_MAX_STREAMS,
    ENV_MAX_WAITERS,
    ENV_PORT,
    ENV_READ_TIMEOUT,
    ENV_TOKEN,
    LOG_FORMATS,
    LOG_LEVELS,
    ConfigError,
    Flags,
    Settings,
    build_settings,
    parse_choice,
    parse_count,
    parse_hosts,
    parse_origins,
    parse_port,
    parse_seconds,
    parse_size,
    source_of,
    write_wizard_config,
)
from nulltickets.errors import TrackerError
from nulltickets.remote import CommandFailed

# Words that mean "run the server" (nullhub launches `<bin> serve`, or `<bin> nulltickets` for
# installs made from the original manifest).
SERVE_WORDS = ("serve", "gateway", "nulltickets")
# What may come first without a command word (anything else starting with "-" is serve's).
TOP_LEVEL = ("-h", "--help", "--version", "--export-manifest", "--from-json")

EPILOG = """Without a command (or with serve, gateway or nulltickets) the server starts.
`nulltickets COMMAND --help` describes each command.

--export-manifest and --from-json count only as the first argument.

configuration: flags win over the config file (--config PATH, else
$NULLTICKETS_HOME/config.json, else ~/.nulltickets/config.json), which wins over the
environment variables (NULLTICKETS_PORT, NULLTICKETS_DB, ...) and the defaults."""


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
    serve = commands.add_parser(
        "serve",
        aliases=["gateway", "nulltickets"],
        help="run the server (the default; gateway and nulltickets are the same)",
        description="Run the server until SIGINT or SIGTERM.",
        epilog=EPILOG.split("\n\n")[-1],
        allow_abbrev=False,
    )
    add_serve_arguments(serve)
    serve.set_defaults(func=serve_command)
    agent.register(commands)
    admin.register(commands)
    db.register(commands)
    migrate_parser = commands.add_parser(
        "migrate",
        help="copy a SQLite tracker into PostgreSQL and verify the counts",
        description=migrate.DESCRIPTION,
    )
    migrate.add_arguments(migrate_parser)
    migrate_parser.set_defaults(func=migrate.main_from_args)
    return p


class _Subparser(_Parser):
    """Subcommands refuse abbreviated flags too (`--po` is not `--port`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    def opt(flag: str, env: str, help_text: str, metavar: str | None = None) -> None:
        p.add_argument(flag, default=None, metavar=metavar, help=f"{help_text} (env {env})")

    p.add_argument(
        "--config",
        default=None,
        metavar="PATH",
        help="config file, which must exist (default $NULLTICKETS_HOME/config.json, if any)",
    )
    opt(
        "--host",
        ENV_HOST,
        "bind address; any but loopback needs a token of 16+ characters (default 127.0.0.1)",
    )
    opt("--port", ENV_PORT, "listen port 0..65535 (default 7700)", metavar="N")
    opt("--db", ENV_DB, "SQLite database file (default nulltickets.db)", metavar="PATH")
    opt("--token", ENV_TOKEN, "admin token every route but /health needs (default: none)")
    opt("--max-body-bytes", ENV_MAX_BODY, "largest request body (default 65536)", metavar="N")
    opt(
        "--durability",
        ENV_DURABILITY,
        "full (default): fsync every commit; normal: fsync only at checkpoints",
        metavar="{full,normal}",
    )
    opt(
        "--read-timeout",
        ENV_READ_TIMEOUT,
        "seconds a client may take to send a request body (default 30)",
        metavar="S",
    )
    p.add_argument(
        "--access-log",
        action="store_true",
        default=None,
        help=f"log every request (env {ENV_ACCESS_LOG}=1)",
    )
    opt("--log-format", ENV_LOG_FORMAT, "text (default) or json lines", metavar="{text,json}")
    opt(
        "--log-level",
        ENV_LOG_LEVEL,
        "debug, info (default), warning, error or critical",
        metavar="LEVEL",
    )
    opt(
        "--allowed-origins",
        ENV_ALLOWED_ORIGINS,
        "comma-separated origins whose web pages may call the server besides its own, e.g. "
        "https://tracker.example.com (default: none)",
        metavar="LIST",
    )
    opt(
        "--allowed-hosts",
        ENV_ALLOWED_HOSTS,
        "comma-separated host names a server without a token answers to besides localhost "
        "and the loopback addresses (default: none)",
        metavar="LIST",
    )
    opt(
        "--max-waiters",
        ENV_MAX_WAITERS,
        "long-poll claims waiting at once at most; beyond, a claim answers at once with "
        "Retry-After (default: what the process can hold, see the start-up line)",
        metavar="N",
    )
    opt(
        "--max-streams",
        ENV_MAX_STREAMS,
        "open event streams at most; beyond, 503 overloaded (default: what the process can hold)",
        metavar="N",
    )
    p.add_argument("--version", action="store_true", help="print the version and exit")


def flags_from_args(args: argparse.Namespace) -> Flags:
    """The serve flags, each value checked here (a bad one is a ConfigError naming the flag)."""

    return Flags(
        config=args.config,
        db=args.db,
        host=args.host,
        port=None if args.port is None else parse_port(args.port, "--port"),
        token=args.token,
        max_body_bytes=None
        if args.max_body_bytes is None
        else parse_size(args.max_body_bytes, "--max-body-bytes"),
        durability=None
        if args.durability is None
        else parse_choice(args.durability, DURABILITIES, "--durability"),
        read_timeout_s=None
        if args.read_timeout is None
        else parse_seconds(args.read_timeout, "--read-timeout"),
        access_log=args.access_log,
        log_format=None
        if args.log_format is None
        else parse_choice(args.log_format, LOG_FORMATS, "--log-format"),
        log_level=None
        if args.log_level is None
        else parse_choice(args.log_level, LOG_LEVELS, "--log-level"),
        allowed_origins=None
        if args.allowed_origins is None
        else parse_origins(args.allowed_origins, "--allowed-origins"),
        allowed_hosts=None
        if args.allowed_hosts is None
        else parse_hosts(args.allowed_hosts, "--allowed-hosts"),
        max_waiters=None
        if args.max_waiters is None
        else parse_count(args.max_waiters, "--max-waiters"),
        max_streams=None
        if args.max_streams is None
        else parse_count(args.max_streams, "--max-streams"),
    )


def settings_from_args(args: argparse.Namespace) -> Settings:
    return build_settings(flags_from_args(args))


def serve_command(args: argparse.Namespace) -> int:
    from nulltickets import logs
    from nulltickets.server.launch import check_settings, preflight, serve, version_line

    if args.version:
        print(version_line())
        return 0
    if args.host is not None and not args.host.strip():
        raise ConfigError("--host must not be empty")
    flags = flags_from_args(args)
    settings = build_settings(flags)
    hide_passwords(settings.db)  # also one from the config file
    logs.configure(settings.log_format, settings.log_level)
    try:
        check_settings(settings)
    except ConfigError as exc:
        # launch names the flag; the host or the token may have come from the file or the
        # environment.
        message = str(exc)
        for setting in ("host", "token"):
            source = source_of(setting, flags)
            if f"--{setting}" in message and source not in (f"--{setting}", "the default"):
                message = message.replace(f"--{setting}", source)
        if message != str(exc):
            raise ConfigError(message) from None
        raise
    preflight(settings)
    serve(settings)
    return 0


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
