"""The commands that open the database file themselves, beside a running server or without one.

    nulltickets backup DEST [--db PATH] [--config PATH] [--force]
    nulltickets doctor [--db PATH] [--config PATH] [--json]

The database is found as `serve` finds it (--db, the config file, NULLTICKETS_DB). The SQLite
work lives in storage/sqlite/maintenance.py.
"""

from __future__ import annotations

import argparse
from typing import Any

from nulltickets.config import ENV_DB, database_path
from nulltickets.remote import CommandFailed


def register(commands: Any) -> None:
    p = commands.add_parser(
        "backup",
        help="copy the database while the server runs (restore: serve the copy)",
        description="Write a consistent copy of the database to DEST through SQLite's backup "
        "API, while the server goes on serving; the copy is checked with integrity_check "
        "before it is put in place. To restore, start the server on the copy "
        "(nulltickets serve --db DEST).",
    )
    p.add_argument("dest", metavar="DEST", help="the file to write (must not exist)")
    _database_options(p)
    p.add_argument("--force", action="store_true", help="overwrite DEST if it exists")
    p.set_defaults(func=backup_command)

    p = commands.add_parser(
        "doctor",
        help="check the database and say what the server would do with it on start",
        description="Check the database without changing it: integrity, WAL size, schema "
        "version against this build's, application_id, whether another process has it open, "
        "and what `serve` would do on start. Exits 1 when something needs attention.",
    )
    _database_options(p)
    p.add_argument("--json", action="store_true", help="the report as one JSON object")
    p.set_defaults(func=doctor_command)


def _database_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--db",
        default=None,
        metavar="PATH",
        help=f"the database (env {ENV_DB}; default: as serve finds it)",
    )
    p.add_argument(
        "--config", default=None, metavar="PATH", help="config file to find the database in"
    )


def backup_command(args: argparse.Namespace) -> int:
    from nulltickets.errors import TrackerError
    from nulltickets.storage.sqlite import maintenance

    source = database_path(args.config, args.db)
    try:
        report = maintenance.backup(source, args.dest, force=args.force)
    except TrackerError as exc:
        raise CommandFailed(exc.message) from None
    print(
        f"backup of {report.source} written to {report.dest}: {report.pages} pages, "
        f"{report.size_bytes} bytes, schema version {report.schema_version}, "
        f"integrity {report.integrity}"
    )
    return 0


def doctor_command(args: argparse.Namespace) -> int:
    import msgspec

    from nulltickets.storage.sqlite import maintenance

    report = maintenance.inspect(database_path(args.config, args.db))
    if args.json:
        print(msgspec.json.encode(report).decode())
    else:
        print(doctor_text(report))
    return 0 if report.ok else 1


def doctor_text(r: Any) -> str:
    in_use = {True: "yes, by another process", False: "no", None: "cannot tell"}[r.in_use]
    app_id = "-" if r.application_id is None else f"{r.application_id:#x} ({r.contents})"
    version = "-" if r.schema_version is None else str(r.schema_version)
    lines = [
        f"database     {r.path}" + ("" if r.exists else " (does not exist)"),
        f"size         {r.size_bytes} bytes, WAL {r.wal_bytes} bytes",
        f"integrity    {r.integrity}",
        f"schema       version {version}, this build's {r.expected_version}",
        f"application  {app_id}",
        f"in use       {in_use}",
        f"on start     {r.on_start}",
    ]
    lines.extend(f"problem      {p}" for p in r.problems)
    lines.extend(f"note         {n}" for n in r.notes)
    lines.append("status       " + ("ok" if r.ok else "needs attention"))
    return "\n".join(lines)
