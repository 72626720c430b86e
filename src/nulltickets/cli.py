"""The `nulltickets` command: parse flags, build Settings, start granian. No logic of its own.

nulltickets [serve|gateway|nulltickets] [flags]   run the server (contract §16.1)
nulltickets --export-manifest                     print nullhub's manifest (§16.4)
nulltickets --from-json '<json>'                  write config.json from wizard answers (§16.5)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import NoReturn

from nulltickets.agent_cli import AGENT_COMMANDS
from nulltickets.config import (
    DURABILITIES,
    ConfigError,
    Flags,
    Settings,
    build_settings,
    parse_port,
    write_wizard_config,
)
from nulltickets.errors import TrackerError
from nulltickets.launch import check_settings, preflight, serve, version_line

# Words that mean "run the server" (nullhub launches `<bin> serve`, or `<bin> nulltickets` for
# installs made from the original manifest).
SERVE_WORDS = ("serve", "gateway", "nulltickets")

USAGE = """nulltickets [serve|gateway|nulltickets] [--config PATH] [--host HOST] [--port N]
                   [--db PATH] [--token T] [--max-body-bytes N] [--durability {full,normal}]
                   [--access-log] [--version]
       nulltickets --export-manifest
       nulltickets --from-json '<json>'
       nulltickets worker --role R [--base URL] [--token T] -- COMMAND [ARG...]
       nulltickets checkpoint '<json>' | event KIND ['<json>'] | pause --agent-id X"""

EPILOG = """configuration: flags win over the config file (--config PATH, else
$NULLTICKETS_HOME/config.json, else ~/.nulltickets/config.json), which wins over
$NULLTICKETS_PORT and the defaults. Config keys: port, db (relative to the file's
directory), api_token (empty or null: no auth), host, durability, max_body_bytes."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """Bad flags are a start-up error: status 1, one line on stderr."""
        self.exit(1, f"nulltickets: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="nulltickets",
        usage=USAGE,
        description="Durable task state for AI agents, served over a JSON HTTP API.",
        epilog=EPILOG,
        allow_abbrev=False,
    )
    p.add_argument(
        "--config", default=None, help="config file (default $NULLTICKETS_HOME/config.json)"
    )
    p.add_argument("--port", default=None, help="listen port 0..65535 (default 7700)")
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    p.add_argument("--db", default=None, help="SQLite database path (default nulltickets.db)")
    p.add_argument("--token", default=None, help="admin API token (default: auth disabled)")
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="largest accepted request body (default 65536)",
    )
    p.add_argument(
        "--durability",
        choices=DURABILITIES,
        default=None,
        help="full (default): fsync every commit; normal: fsync only at checkpoints",
    )
    p.add_argument(
        "--read-timeout",
        type=float,
        default=None,
        help="seconds a client may take to send a request body (default 30)",
    )
    p.add_argument("--access-log", action="store_true", help="log every request")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    return p


def _value_flags(parser: argparse.ArgumentParser) -> set[str]:
    return {
        opt
        for action in parser._actions
        if action.nargs is None and action.option_strings
        for opt in action.option_strings
    }


def flags_from_args(args: argparse.Namespace) -> Flags:
    return Flags(
        config=args.config,
        db=args.db,
        host=args.host,
        port=None if args.port is None else parse_port(args.port, "--port"),
        token=args.token,
        max_body_bytes=args.max_body_bytes,
        durability=args.durability,
        read_timeout_s=args.read_timeout,
        access_log=args.access_log,
    )


def settings_from_args(args: argparse.Namespace) -> Settings:
    return build_settings(flags_from_args(args))


def export_manifest() -> int:
    from nulltickets.manifest import manifest

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


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    # Both modes count only as the first argument, like the original's.
    if args_in[:1] == ["--export-manifest"]:
        return export_manifest()
    if args_in[:1] == ["--from-json"]:
        return from_json(args_in[1:])
    if args_in[:1] and args_in[0] in AGENT_COMMANDS:
        from nulltickets.agent_cli import main as agent_main

        return agent_main(args_in)
    parser = _parser()
    # Unknown arguments, and a value flag given last without its value, are ignored (§16.1)
    # but named on stderr.
    dangling: list[str] = []
    while args_in and args_in[-1] in _value_flags(parser):
        dangling.insert(0, args_in.pop())
    args, unknown = parser.parse_known_args(args_in)
    ignored = [a for a in unknown + dangling if a not in SERVE_WORDS]
    if args.version:
        print(version_line())
        return 0
    if ignored:
        print(f"nulltickets: ignoring {' '.join(ignored)}", file=sys.stderr)
    try:
        settings = settings_from_args(args)
        check_settings(settings)
        preflight(settings)
    except ConfigError as exc:
        print(f"nulltickets: {exc}", file=sys.stderr)
        return 1
    except TrackerError as exc:
        print(f"nulltickets: {exc.message}", file=sys.stderr)
        return 1
    serve(settings)
    return 0
