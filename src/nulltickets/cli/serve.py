"""`nulltickets serve` (also `gateway`, `nulltickets`, or no command word at all): the server's
flags, each checked here, then the start-up of `server/launch.py` (contract §16.1)."""

from __future__ import annotations

import argparse
from typing import Any

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
    ENV_PRUNE_INTERVAL,
    ENV_READ_TIMEOUT,
    ENV_RETENTION,
    ENV_RETENTION_EXPORT,
    ENV_TOKEN,
    LOG_FORMATS,
    LOG_LEVELS,
    ConfigError,
    Flags,
    Settings,
    build_settings,
    parse_choice,
    parse_count,
    parse_db,
    parse_hosts,
    parse_interval,
    parse_origins,
    parse_port,
    parse_retention,
    parse_seconds,
    parse_size,
    source_of,
)

# Words that mean "run the server" (nullhub launches `<bin> serve`, or `<bin> nulltickets` for
# installs made from the original manifest).
SERVE_WORDS = ("serve", "gateway", "nulltickets")

CONFIGURATION = """configuration: flags win over the config file (--config PATH, else
$NULLTICKETS_HOME/config.json, else ~/.nulltickets/config.json), which wins over the
environment variables (NULLTICKETS_PORT, NULLTICKETS_DB, ...) and the defaults."""


def register(commands: Any) -> None:
    serve = commands.add_parser(
        SERVE_WORDS[0],
        aliases=list(SERVE_WORDS[1:]),
        help="run the server (the default; gateway and nulltickets are the same)",
        description="Run the server until SIGINT or SIGTERM.",
        epilog=CONFIGURATION,
        allow_abbrev=False,
    )
    add_serve_arguments(serve)
    serve.set_defaults(func=serve_command)


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
    opt(
        "--retention",
        ENV_RETENTION,
        "prune finished tasks and their runs, events, spans and recorded answers older than "
        "this, in the background: a duration like 30d, 12h, 90m, or off (default 30d)",
        metavar="DURATION",
    )
    opt(
        "--prune-interval",
        ENV_PRUNE_INTERVAL,
        "how often the background pruning looks for work (default 60s)",
        metavar="DURATION",
    )
    opt(
        "--retention-export",
        ENV_RETENTION_EXPORT,
        "append every row the background pruning deletes to this JSON-lines file first "
        "(default: none)",
        metavar="FILE",
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
        retention_s=None
        if args.retention is None
        else parse_retention(args.retention, "--retention"),
        prune_interval_s=None
        if args.prune_interval is None
        else parse_interval(args.prune_interval, "--prune-interval"),
        retention_export=None
        if args.retention_export is None
        else parse_db(args.retention_export, "--retention-export"),
    )


def settings_from_args(args: argparse.Namespace) -> Settings:
    return build_settings(flags_from_args(args))


def serve_command(args: argparse.Namespace) -> int:
    from nulltickets import logs
    from nulltickets.server.launch import check_settings, preflight, serve, version_line
    from nulltickets.storage.dsn import secrets_of

    if args.version:
        print(version_line())
        return 0
    if args.host is not None and not args.host.strip():
        raise ConfigError("--host must not be empty")
    flags = flags_from_args(args)
    settings = build_settings(flags)
    logs.hide(*secrets_of(settings.db))  # a password of the config file's too
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
