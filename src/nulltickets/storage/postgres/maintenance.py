"""`nulltickets doctor` on a PostgreSQL database: can the server reach it, which migrations it
holds against this build's, whether it is writable, who else uses it, and what `serve` would
do with it on start. One read-only transaction; nothing is changed. The report and every
message in it show the URL without its password (libpq may quote either in an error)."""

from __future__ import annotations

from typing import Any

import msgspec
import psycopg

from nulltickets.storage.dsn import display_name, redact
from nulltickets.storage.postgres.migrate import Q, migrations

CONNECT_TIMEOUT_S = 3
# The oldest PostgreSQL the server runs on (the README says so; the tests run on 15).
OLDEST_VERSION_NUM = 120000


class PostgresDoctorReport(msgspec.Struct):
    """What `nulltickets doctor` prints for a PostgreSQL database. `ok` is false when it needs
    attention (the server would refuse it, or it holds something else)."""

    database: str  # the URL without its password
    reachable: bool
    server_version: str | None
    size_bytes: int
    integrity: str  # "ok", the indexes PostgreSQL will not use, or "not checked"
    schema_version: int | None  # the highest migration applied; 0 for an empty database
    expected_version: int
    contents: str  # nulltickets, empty, foreign (another program's tables), none (unreachable)
    writable: bool | None  # a read-only database or standby refuses the server's writes
    in_use: bool | None  # another session is connected to the database
    sessions: int  # how many
    on_start: str
    ok: bool
    problems: list[str]
    notes: list[str]
    engine: str = "postgresql"


def inspect(url: str) -> PostgresDoctorReport:
    expected = len(migrations())
    report = PostgresDoctorReport(
        database=display_name(url),
        reachable=False,
        server_version=None,
        size_bytes=0,
        integrity="not checked",
        schema_version=None,
        expected_version=expected,
        contents="none",
        writable=None,
        in_use=None,
        sessions=0,
        on_start="",
        ok=False,
        problems=[],
        notes=[],
    )
    try:
        with psycopg.connect(url, connect_timeout=CONNECT_TIMEOUT_S) as conn:
            conn.read_only = True
            _inspect_open(conn, report, expected)
            conn.rollback()
    except psycopg.Error as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        reason = redact(first, url)
        stage = "cannot read it" if report.reachable else "cannot connect"
        return _refuse(report, f"{stage}: {reason}")
    return report


def _inspect_open(
    conn: psycopg.Connection[Any], report: PostgresDoctorReport, expected: int
) -> None:
    server = conn.execute(Q["doctor_server"]).fetchone()
    assert server is not None
    version, version_num, size, read_only, can_create, migrated, tables = server
    report.reachable = True
    report.server_version, report.size_bytes = str(version), int(size)
    report.writable = not read_only
    (sessions,) = conn.execute(Q["doctor_sessions"]).fetchone() or (0,)
    report.sessions = int(sessions)
    report.in_use = report.sessions > 0
    invalid = [str(name) for (name,) in conn.execute(Q["doctor_invalid_indexes"])]
    report.integrity = "ok" if not invalid else f"indexes not valid: {', '.join(invalid)}"
    if invalid:
        report.problems.append(
            f"PostgreSQL will not use {', '.join(invalid)} (rebuild them with REINDEX)"
        )
    applied = [int(v) for (v,) in conn.execute(Q["schema_versions"])] if migrated else []
    version_applied = max(applied, default=0)
    report.schema_version = version_applied
    if migrated:
        report.contents = "nulltickets"
    elif tables:
        report.contents = "foreign"
        report.problems.append(
            f"the database holds {tables} tables of another program and no nulltickets "
            "schema: is it the right database?"
        )
    else:
        report.contents = "empty"
    if applied != list(range(1, version_applied + 1)):
        report.problems.append(f"migrations applied with gaps: {applied}")
    if version_num < OLDEST_VERSION_NUM:
        _refuse(report, f"PostgreSQL {version} is older than 12")
        return
    if version_applied > expected:
        _refuse(
            report,
            f"schema version {version_applied} is newer than this nulltickets ({expected}): "
            "run the newer version",
        )
        return
    if read_only:
        _refuse(report, "the database is read-only (a standby, or read-only by default)")
        return
    if version_applied < expected and not can_create:
        _refuse(report, "this user may not create tables in the database's schema")
        return
    if version_applied == expected:
        report.on_start = "nothing to migrate: serve it as it is"
    elif report.contents == "empty":
        report.on_start = f"create the tables: migrate from 0 to {expected}"
    else:
        report.on_start = f"migrate from version {version_applied} to {expected}"
    if report.in_use:
        report.notes.append(
            f"{report.sessions} other sessions are connected (servers of this tracker, or "
            "other clients)"
        )
    report.ok = not report.problems


def _refuse(report: PostgresDoctorReport, reason: str) -> PostgresDoctorReport:
    report.on_start = f"refuse to start: {reason}"
    report.problems.append(reason)
    report.ok = False
    return report
