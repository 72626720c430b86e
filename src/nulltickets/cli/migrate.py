"""`nulltickets migrate --from nulltickets.db --to postgresql://...`: move a tracker from its
SQLite file onto PostgreSQL (storage/transfer.py does the copying). Exit status 0 when every
row was copied and counted, 1 with one line on stderr otherwise."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from nulltickets.errors import TrackerError

DESCRIPTION = (
    "Copy every row of a SQLite database (tasks, runs, events, store, idempotency records, "
    "pipelines, dependencies, assignments, artifacts, checkpoints, spans) into a PostgreSQL "
    "database, in one transaction, and verify the counts."
)


def register(commands: Any) -> None:
    migrate = commands.add_parser(
        "migrate",
        help="copy a SQLite tracker into PostgreSQL and verify the counts",
        description=DESCRIPTION,
    )
    add_arguments(migrate)
    migrate.set_defaults(func=main_from_args)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--from", dest="source", required=True, metavar="PATH", help="the SQLite database file"
    )
    parser.add_argument(
        "--to", dest="target", required=True, metavar="URL", help="postgresql://... to copy into"
    )
    parser.add_argument(
        "--replace",
        action="store_true",
        help="empty the target first if it already holds data (default: refuse)",
    )
    parser.add_argument("--quiet", action="store_true", help="print nothing on success")


def main_from_args(args: argparse.Namespace) -> int:
    from nulltickets.storage.factory import display_name, is_postgres

    if not is_postgres(args.target):
        print("nulltickets migrate: --to must be a postgresql:// URL", file=sys.stderr)
        return 1
    if is_postgres(args.source):
        print("nulltickets migrate: --from must be a SQLite database file", file=sys.stderr)
        return 1
    try:
        from nulltickets.storage.transfer import copy_sqlite_to_postgres

        copied = copy_sqlite_to_postgres(args.source, args.target, replace=args.replace)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] in ("psycopg", "psycopg_pool"):
            print(
                "nulltickets migrate: PostgreSQL needs the psycopg driver: "
                "pip install 'nulltickets[postgres]'",
                file=sys.stderr,
            )
            return 1
        raise
    except TrackerError as exc:
        print(f"nulltickets migrate: {exc}", file=sys.stderr)
        return 1
    if not args.quiet:
        tables = ", ".join(f"{t} {n}" for t, n in copied.counts.items() if n)
        print(
            f"copied {copied.total} rows from {args.source} to {display_name(args.target)}"
            f" ({tables or 'no rows'}); counts verified"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nulltickets migrate", description=DESCRIPTION)
    add_arguments(parser)
    return main_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
