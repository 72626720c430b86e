"""The `nulltickets` command: parse flags, build Settings, start granian. No logic of its own."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from collections.abc import Sequence

from nulltickets import __version__, core
from nulltickets.config import ENV_SETTINGS, Settings
from nulltickets.errors import TrackerError

# Words that mean "run the server" (nullhub launches `<bin> nulltickets` or `<bin> serve`).
SERVE_WORDS = ("serve", "gateway", "nulltickets")


def version_line() -> str:
    return f"nulltickets v{__version__} (core: {core.IMPLEMENTATION})"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nulltickets",
        description="Durable task state for AI agents, served over a JSON HTTP API.",
    )
    p.add_argument(
        "command",
        nargs="?",
        choices=SERVE_WORDS,
        default="serve",
        help="run the server (the default; all three words mean the same)",
    )
    p.add_argument("--port", type=int, default=None, help="listen port (default 7700)")
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
        choices=("full", "normal"),
        default=None,
        help="fsync every commit (full) or only at checkpoints (normal)",
    )
    p.add_argument("--access-log", action="store_true", help="log every request")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    return p


def settings_from_args(args: argparse.Namespace) -> Settings:
    base = Settings()
    token = args.token if args.token is not None else base.token
    return Settings(
        db=args.db or base.db,
        host=args.host or base.host,
        port=args.port if args.port is not None else base.port,
        token=token or None,
        max_body_bytes=args.max_body_bytes or base.max_body_bytes,
        durability=args.durability or base.durability,
        access_log=args.access_log,
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_settings(settings: Settings) -> None:
    if not 0 <= settings.port <= 65535:
        raise SystemExit(f"nulltickets: --port must be 0..65535, got {settings.port}")
    if settings.max_body_bytes < 1024:
        raise SystemExit("nulltickets: --max-body-bytes must be at least 1024")
    if not is_loopback(settings.host) and not settings.token:
        raise SystemExit(
            f"nulltickets: refusing to listen on {settings.host} without a token; "
            "pass --token (or set api_token in the config) or bind 127.0.0.1"
        )


def preflight(settings: Settings) -> None:
    """Open, check and migrate the database before serving, so that a bad path, a read-only
    file or an old SQLite is a clear start-up error; the connection is closed before the
    worker starts (SQLite connections must not cross a fork)."""
    from nulltickets.storage.sqlite import connection

    connection.check_sqlite()
    connection.ensure_parent(settings.db)
    connection.check_writable(settings.db)
    conn = connection.connect_writer(settings.db, settings.durability)
    try:
        connection.migrate(conn)
    finally:
        conn.close()


def serve(settings: Settings) -> None:
    from granian.constants import HTTPModes, Interfaces, Loops
    from granian.http import HTTP1Settings
    from granian.server import Server

    from nulltickets.http.app import load_app

    os.environ[ENV_SETTINGS] = settings.to_env()
    auth = "enabled" if settings.token else "disabled"
    print(
        f"{version_line()}: db {settings.db}, auth {auth}, "
        f"listening on http://{settings.host}:{settings.port}",
        file=sys.stderr,
    )
    server = Server(
        "nulltickets.http.app:load_app",
        address=settings.host,
        port=settings.port,
        interface=Interfaces.RSGI,
        workers=1,
        loop=Loops.asyncio,
        http=HTTPModes.http1,
        websockets=False,
        http1_settings=HTTP1Settings(header_read_timeout=settings.header_timeout_ms),
        log_enabled=True,
        log_access=settings.access_log,
    )
    server.serve(target_loader=load_app)


def main(argv: Sequence[str] | None = None) -> int:
    args, _unknown = _parser().parse_known_args(argv)
    if args.version:
        print(version_line())
        return 0
    settings = settings_from_args(args)
    check_settings(settings)
    try:
        preflight(settings)
    except TrackerError as exc:
        print(f"nulltickets: {exc.message}", file=sys.stderr)
        return 1
    serve(settings)
    return 0
