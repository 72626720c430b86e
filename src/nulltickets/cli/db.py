"""The commands that open the database themselves, beside a running server or without one.

    nulltickets backup DEST [--db PATH] [--config PATH] [--force]
    nulltickets doctor [--db PATH|URL] [--config PATH] [--json]
    nulltickets prune --older-than DURATION [--export FILE] [--vacuum] [--db PATH|URL] [--json]

The database is found as `serve` finds it (--db, the config file, NULLTICKETS_DB). The SQLite
work lives in storage/sqlite/maintenance.py, doctor's on PostgreSQL in
storage/postgres/maintenance.py; `backup` of a PostgreSQL database points to pg_dump. Nothing
shows a database URL's password.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from nulltickets.client.remote import CommandFailed
from nulltickets.config import ENV_DB, database_path


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

    p = commands.add_parser(
        "prune",
        help="delete finished tasks and their history older than a duration",
        description="Delete the finished tasks (in a terminal stage, or dead-lettered or "
        "cancelled with nothing depending on them) that last changed more than DURATION ago, "
        "with their runs, usage, events, artifacts and spans, plus older loose spans and "
        "recorded answers of idempotent requests, in small transactions, beside a running "
        "server or without one. Tasks that are not finished keep all their history. The "
        "servers do the same in the background with --retention.",
    )
    p.add_argument(
        "--older-than",
        required=True,
        metavar="DURATION",
        help="what to prune: finished longer ago than this (30d, 12h, 90m, 0s for all)",
    )
    p.add_argument(
        "--export",
        metavar="FILE",
        help="append every deleted row to FILE first (JSON lines, fsynced before the delete "
        "commits; the file is made readable by its owner only)",
    )
    p.add_argument(
        "--vacuum",
        action="store_true",
        help="SQLite: then give the free pages back to the file system; a file made before "
        "retention existed is switched to incremental vacuum once, by a full VACUUM that "
        "holds the server's writes up while it runs",
    )
    _database_options(p)
    p.add_argument("--json", action="store_true", help="the report as one JSON object")
    p.set_defaults(func=prune_command)


def _database_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--db",
        default=None,
        metavar="PATH",
        help=f"the database: a SQLite file or a postgresql:// URL (env {ENV_DB}; default: as "
        "serve finds it)",
    )
    p.add_argument(
        "--config", default=None, metavar="PATH", help="config file to find the database in"
    )


def _database(args: argparse.Namespace) -> str:
    from nulltickets import logs
    from nulltickets.storage.factory import secrets_of

    target = database_path(args.config, args.db)
    logs.hide(*secrets_of(target))  # also one from the config file
    return target


def backup_command(args: argparse.Namespace) -> int:
    from nulltickets import logs
    from nulltickets.errors import TrackerError
    from nulltickets.storage.factory import display_name, is_postgres
    from nulltickets.storage.sqlite import maintenance

    source = _database(args)
    if is_postgres(source):
        # PostgreSQL's own tools copy a live database consistently, and restore it.
        raise CommandFailed(
            f"backup copies a SQLite file; {display_name(source)} is PostgreSQL: back it up with "
            f"pg_dump (pg_dump --format=custom --file {args.dest} DBURL; restore with "
            "pg_restore --dbname DBURL FILE; the password from PGPASSWORD or ~/.pgpass)"
        )
    try:
        report = maintenance.backup(source, args.dest, force=args.force)
    except TrackerError as exc:
        raise CommandFailed(exc.message) from None
    print(
        logs.scrub(
            f"backup of {report.source} written to {report.dest}: {report.pages} pages, "
            f"{report.size_bytes} bytes, schema version {report.schema_version}, "
            f"integrity {report.integrity}"
        )
    )
    return 0


def doctor_command(args: argparse.Namespace) -> int:
    import msgspec

    from nulltickets import logs
    from nulltickets.storage.factory import inspect_postgres, is_postgres
    from nulltickets.storage.sqlite import maintenance

    target = _database(args)
    if is_postgres(target):
        report = inspect_postgres(target)
        text = postgres_doctor_text(report)
    else:
        report = maintenance.inspect(target)
        text = doctor_text(report)
    print(logs.scrub(msgspec.json.encode(report).decode() if args.json else text))
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


def postgres_doctor_text(r: Any) -> str:
    server = f"PostgreSQL {r.server_version}" if r.reachable else "not reached"
    version = "-" if r.schema_version is None else str(r.schema_version)
    writable = {True: "yes", False: "no (read-only)", None: "cannot tell"}[r.writable]
    in_use = f"yes, by {r.sessions} other sessions" if r.in_use else "no"
    lines = [
        f"database     {r.database}",
        f"server       {server}",
        f"size         {r.size_bytes} bytes",
        f"integrity    {r.integrity}",
        f"schema       version {version}, this build's {r.expected_version}",
        f"contents     {r.contents}",
        f"writable     {writable}",
        f"in use       {in_use if r.in_use is not None else 'cannot tell'}",
        f"on start     {r.on_start}",
    ]
    lines.extend(f"problem      {p}" for p in r.problems)
    lines.extend(f"note         {n}" for n in r.notes)
    lines.append("status       " + ("ok" if r.ok else "needs attention"))
    return "\n".join(lines)


def prune_command(args: argparse.Namespace) -> int:
    import msgspec

    from nulltickets import logs
    from nulltickets.config import parse_age
    from nulltickets.domain.clock import wall_ms
    from nulltickets.service.retention import Export, Pruner
    from nulltickets.storage.factory import display_name, is_postgres, open_database
    from nulltickets.storage.sqlite import maintenance

    older_than = parse_age(args.older_than, "--older-than")
    target = _database(args)
    if not is_postgres(target) and not Path(target).is_file():
        raise CommandFailed(f"database {target} does not exist")  # never make an empty one
    switched = None
    if args.vacuum and not is_postgres(target):
        # Before the server-side pruning's own steps can give pages back, the file must keep
        # the list they need: one VACUUM, once (nothing to do for a file made since).
        switched = maintenance.enable_incremental_vacuum(target)
    export = None if args.export is None else Export(args.export)
    database = open_database(target, readers=1)
    try:
        pruner = Pruner(database, export)
        report = pruner.prune(wall_ms() - int(older_than * 1000), vacuum=args.vacuum)
    finally:
        database.close()
        if export is not None:
            export.close()
    if args.json:
        doc = msgspec.to_builtins(report) | {"vacuum_switched": switched}
        print(msgspec.json.encode(doc).decode())
        return 0
    deleted = ", ".join(f"{n} {table}" for table, n in sorted(report.deleted.items()) if n)
    lines = [f"pruned {display_name(target)}: {deleted or 'nothing older'}"]
    if export is not None:
        lines.append(f"exported {report.exported} rows to {args.export}")
    if switched:
        lines.append("switched the file to incremental vacuum (one full VACUUM)")
    if report.pages_before is not None and report.pages_after is not None:
        lines.append(
            f"file {report.pages_before} pages before, {report.pages_after} after, "
            f"{report.free_pages} free"
        )
    if args.vacuum and is_postgres(target):
        lines.append(
            "PostgreSQL: autovacuum makes the space reusable; VACUUM FULL gives it back but "
            "locks each table while it runs"
        )
    print(logs.scrub("\n".join(lines)))
    return 0
