"""Moving over: every row of a SQLite database copied into a PostgreSQL one.

`copy_sqlite_to_postgres` brings both databases to the latest schema (each backend's own
migrations), then copies table by table in one PostgreSQL transaction, in insertion order and
with every id kept, resets the sequences behind the ids, and compares every table's count
before it commits: the target has all of the source or nothing of it. A target that already
holds data is refused unless `replace` says to empty it first (in that same transaction).

It needs both drivers, so it lives here, beside both backends, and nothing above storage/
imports it but the command (cli/migrate.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nulltickets.errors import StartupError
from nulltickets.storage.queries import load_queries

Q = load_queries("nulltickets.storage", "transfer.sql")  # as apsw takes them (sqlite_*)
QP = load_queries("nulltickets.storage", "transfer.sql", "pyformat")  # as psycopg does (pg_*)

# Every table, parents before children. pipeline_stage_roles comes before pipeline_stages: on
# PostgreSQL a trigger keeps it derived from pipeline_stages, and upserts what is already there.
TABLES = (
    "pipelines",
    "pipeline_stage_roles",
    "pipeline_stages",
    "tasks",
    "runs",
    "leases",
    "events",
    "artifacts",
    "task_dependencies",
    "task_assignments",
    "task_events",
    "idempotency_keys",
    "otlp_batches",
    "otlp_spans",
    "store",
    "api_keys",
)
# A table holding any of these rows makes the target "not empty".
CONTENT = ("pipelines", "tasks", "store", "idempotency_keys", "otlp_batches", "api_keys")
# PostgreSQL columns with SQLite's insertion order (rowid).
SEQ = "seq"


class TransferError(StartupError):
    """Why a copy did not happen (one line); nothing was written to the target."""


@dataclass(frozen=True, slots=True)
class Copied:
    """Rows copied per table (equal in both databases once the copy committed)."""

    counts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _ident(name: str) -> str:
    """A SQLite identifier from our own table list or the file's catalogue, quoted."""
    return '"' + name.replace('"', '""') + '"'


def copy_sqlite_to_postgres(
    source: str,
    target: str,
    *,
    replace: bool = False,
    progress: Callable[[str, int], None] | None = None,
) -> Copied:
    """Copy every row of the SQLite file `source` into the PostgreSQL database `target`."""
    import apsw
    import psycopg
    from psycopg import sql

    from nulltickets.storage.dsn import display_name, redact
    from nulltickets.storage.postgres.database import PostgresDatabase
    from nulltickets.storage.sqlite import connection
    from nulltickets.storage.sqlite.database import SqliteDatabase

    if not _exists(source):
        raise TransferError(f"no SQLite database at {source}")
    where = display_name(target)
    # Both at the latest schema: the source as serving it would leave it, the target migrated.
    sqlite_db = SqliteDatabase(source)
    sqlite_db.open()
    sqlite_db.close()
    pg_db = PostgresDatabase(target)
    pg_db.open()
    pg_db.close()

    src = connection.connect_reader(source)
    try:
        src.execute("BEGIN")  # one snapshot of the source for the whole copy
        with psycopg.connect(target) as dst:
            counts = _copy(src, dst, sql, replace=replace, where=where, progress=progress)
            dst.commit()
        return Copied(counts)
    except psycopg.Error as exc:
        first = redact((str(exc).strip().splitlines() or [type(exc).__name__])[0], target)
        raise TransferError(f"copy into {where} failed, nothing was written: {first}") from None
    except apsw.Error as exc:
        raise TransferError(f"cannot read {source}: {exc}") from None
    finally:
        if src.in_transaction:
            src.execute("COMMIT")
        src.close()


def _exists(path: str) -> bool:
    from pathlib import Path

    return Path(path).expanduser().is_file()


def _copy(
    src: Any,
    dst: Any,
    sql: Any,
    *,
    replace: bool,
    where: str,
    progress: Callable[[str, int], None] | None,
) -> dict[str, int]:
    def pg(name: str, **idents: Any) -> Any:
        return sql.SQL(QP[name]).format(**idents)

    def sqlite(name: str, table: str, columns: list[str] | None = None) -> str:
        text = Q[name].replace("{table}", _ident(table))
        if columns is not None:
            text = text.replace("{columns}", ", ".join(_ident(c) for c in columns))
        return text

    holding = [
        t for t in CONTENT if dst.execute(pg("pg_count", table=sql.Identifier(t))).fetchone()[0] > 0
    ]
    if holding:
        if not replace:
            raise TransferError(
                f"{where} already holds data (in {', '.join(holding)}): "
                "copy into an empty database, or pass --replace to empty it first"
            )
        tables = sql.SQL(", ").join(sql.Identifier(t) for t in TABLES)
        dst.execute(pg("pg_truncate", tables=tables))

    counts: dict[str, int] = {}
    for table in TABLES:
        source_columns = [r[0] for r in src.execute(Q["sqlite_columns"], {"table": table})]
        target_columns = [r[0] for r in dst.execute(QP["pg_columns"], {"table": table})]
        if not target_columns:
            raise TransferError(f"{where} has no table {table}: is it a nulltickets database?")
        columns = [c for c in source_columns if c in target_columns]
        with_seq = SEQ in target_columns and SEQ not in source_columns
        names = columns + ([SEQ] if with_seq else [])
        copy = pg(
            "pg_copy",
            table=sql.Identifier(table),
            columns=sql.SQL(", ").join(sql.Identifier(c) for c in names),
        )
        n = 0
        with dst.cursor().copy(copy) as writer:
            for row in src.execute(sqlite("sqlite_rows", table, columns)):
                rowid, values = row[0], list(row[1:])
                if with_seq:
                    values.append(rowid)
                writer.write_row(values)
                n += 1
        for (column,) in dst.execute(QP["pg_identity_columns"], {"table": table}).fetchall():
            dst.execute(
                pg("pg_reset_identity", table=sql.Identifier(table), column=sql.Identifier(column)),
                {"qualified": table, "column": column},
            )
        expected = int(next(iter(src.execute(sqlite("sqlite_count", table))))[0])
        got = int(dst.execute(pg("pg_count", table=sql.Identifier(table))).fetchone()[0])
        if not expected == got == n:
            raise TransferError(
                f"{table}: {expected} rows in the source but {got} in the target; "
                "nothing was written"
            )
        counts[table] = got
        if progress is not None:
            progress(table, got)
    # Once more at the end, every table: nothing copied later (a trigger) changed a count.
    for table in TABLES:
        expected = int(next(iter(src.execute(sqlite("sqlite_count", table))))[0])
        got = int(dst.execute(pg("pg_count", table=sql.Identifier(table))).fetchone()[0])
        if expected != got:
            raise TransferError(
                f"{table}: {expected} rows in the source but {got} in the target; "
                "nothing was written"
            )
    return counts
