"""Operator work on a database file, beside a running server or without one: an online backup
through SQLite's backup API, an inspection of what the file holds and what the server would
do with it on start, and the one-time switch of an older file to incremental vacuum. Only
that switch writes to the database."""

from __future__ import annotations

import contextlib
import os
import struct
import sys
from pathlib import Path

import apsw
import msgspec

from nulltickets.errors import MaintenanceError, TrackerError
from nulltickets.storage.sqlite import connection

# Byte 128 of the -shm file is SQLite's "dead man switch" (UNIX_SHM_DMS in os_unix.c): every
# connection to a WAL database holds a read lock on it for as long as it is open.
_SHM_DMS = 128


class BackupReport(msgspec.Struct):
    source: str
    dest: str
    pages: int
    size_bytes: int
    schema_version: int
    integrity: str


class DoctorReport(msgspec.Struct):
    """What `nulltickets doctor` prints. `ok` is false when the file needs attention."""

    path: str
    exists: bool
    size_bytes: int
    wal_bytes: int
    is_database: bool
    integrity: str  # "ok", the first problems integrity_check found, or "not checked"
    schema_version: int | None
    expected_version: int
    application_id: int | None
    contents: str  # nulltickets, original (the reference schema), empty, foreign, none
    in_use: bool | None  # another process has the database open (None: cannot tell)
    on_start: str  # what `nulltickets serve` would do with this file
    ok: bool
    problems: list[str]
    notes: list[str]


# --- backup ------------------------------------------------------------------------------------


def backup(source: str, dest: str, *, force: bool = False) -> BackupReport:
    """Copy `source` to `dest` in one read transaction of the source, so the copy is the
    database as of one commit while writers go on (WAL lets them). The copy is written beside
    `dest`, checked with integrity_check, and only then renamed into place."""
    src_path, dest_path = Path(source), Path(dest)
    if not src_path.is_file():
        raise MaintenanceError(f"database {source} does not exist")
    if dest_path.exists():
        if not force:
            raise MaintenanceError(f"{dest} already exists; pass --force to overwrite it")
        if dest_path.resolve() == src_path.resolve():
            raise MaintenanceError(f"{dest} is the database itself")
        if dest_path.is_dir():
            raise MaintenanceError(f"{dest} is a directory")
    if not dest_path.absolute().parent.is_dir():
        raise MaintenanceError(f"directory {dest_path.absolute().parent} does not exist")
    partial = dest_path.absolute().parent / f".{dest_path.name}.partial-{os.getpid()}"
    try:
        with connection.opening(source):
            src = connection.connect_reader(source)
            try:
                out = apsw.Connection(str(partial))
                try:
                    with out.backup("main", src, "main") as job:
                        # All pages in one step: one read transaction, one snapshot. In smaller
                        # steps SQLite would restart the copy after each commit of the server.
                        job.step(-1)
                        pages = job.page_count
                finally:
                    out.close()
            finally:
                src.close()
        integrity, version = _check_copy(partial)
        if integrity != "ok":
            raise MaintenanceError(f"the copy failed integrity_check: {integrity}")
        os.replace(partial, dest_path)
    except apsw.Error as exc:
        raise MaintenanceError(f"backup to {dest} failed: {exc}") from None
    except OSError as exc:
        raise MaintenanceError(f"backup to {dest} failed: {exc.strerror or exc}") from None
    finally:
        for leftover in (partial, *_sidecars(partial)):
            with contextlib.suppress(OSError):
                leftover.unlink()
    return BackupReport(
        source=source,
        dest=dest,
        pages=pages,
        size_bytes=dest_path.stat().st_size,
        schema_version=version,
        integrity=integrity,
    )


def _check_copy(path: Path) -> tuple[str, int]:
    conn = connection.connect_reader(str(path))
    try:
        return _integrity(conn), int(conn.pragma("user_version"))
    finally:
        conn.close()


def _sidecars(path: Path) -> list[Path]:
    return [path.with_name(path.name + suffix) for suffix in ("-wal", "-shm", "-journal")]


# --- incremental vacuum ------------------------------------------------------------------------


def enable_incremental_vacuum(path: str) -> bool:
    """Have the file give free pages back (auto_vacuum INCREMENTAL): a file made before
    retention needs one VACUUM to keep the pointer map that takes. VACUUM rewrites the whole
    file in one transaction (a crash leaves the old file as it was) and holds every writer up
    meanwhile; it needs free disk space of about the file's size. True when it switched,
    False when the file already gives pages back."""
    if not Path(path).is_file():
        raise MaintenanceError(f"database {path} does not exist")
    with connection.opening(path):
        conn = connection.connect_writer(path)
    try:
        if int(conn.pragma("auto_vacuum")) == connection.INCREMENTAL_VACUUM:
            return False
        conn.pragma("auto_vacuum", connection.INCREMENTAL_VACUUM)
        conn.execute("VACUUM").fetchall()
        return int(conn.pragma("auto_vacuum")) == connection.INCREMENTAL_VACUUM
    except apsw.BusyError:
        raise MaintenanceError(
            f"{path} is busy: the VACUUM could not take the write lock; try again when the "
            "server is quieter, or with it stopped"
        ) from None
    except apsw.Error as exc:
        raise MaintenanceError(f"VACUUM of {path} failed: {exc}") from None
    finally:
        conn.close()


# --- inspection --------------------------------------------------------------------------------


def inspect(path: str) -> DoctorReport:
    """Look at the file without changing it: integrity, WAL size, schema version against the
    migrations this build carries, application_id, whether another process has it open, and
    what the server would do on start (create, migrate from N to M, nothing, or refuse)."""
    expected = len(connection.migrations())
    p = Path(path)
    wal = p.with_name(p.name + "-wal")
    report = DoctorReport(
        path=path,
        exists=p.is_file(),
        size_bytes=p.stat().st_size if p.is_file() else 0,
        wal_bytes=wal.stat().st_size if wal.is_file() else 0,
        is_database=False,
        integrity="not checked",
        schema_version=None,
        expected_version=expected,
        application_id=None,
        contents="none",
        in_use=None,
        on_start="",
        ok=False,
        problems=[],
        notes=[],
    )
    if not report.exists:
        if p.exists():
            return _refuse(report, f"{path} is not a regular file")
        report.on_start = f"create a new database and migrate it to version {expected}"
        report.ok = True
        return report
    report.in_use = in_use(path)  # before our own connection: see in_use()
    try:
        with connection.opening(path):
            conn = connection.connect_reader(path)
    except (TrackerError, apsw.Error) as exc:
        return _refuse(report, str(exc))
    try:
        return _inspect_open(conn, report, expected)
    finally:
        conn.close()


def _inspect_open(conn: apsw.Connection, report: DoctorReport, expected: int) -> DoctorReport:
    try:
        version = int(conn.pragma("user_version"))
        app_id = int(conn.pragma("application_id"))
        tables = {
            str(name)
            for (name,) in conn.execute("SELECT name FROM sqlite_schema WHERE type = 'table'")
        }
    except apsw.NotADBError:
        return _refuse(report, f"{report.path} is not an SQLite database")
    except apsw.Error as exc:
        return _refuse(report, f"cannot read {report.path}: {exc}")
    report.is_database = True
    report.schema_version, report.application_id = version, app_id
    report.contents = _contents(version, app_id, tables)
    try:
        report.integrity = _integrity(conn)
    except apsw.Error as exc:
        report.integrity = str(exc)
    if report.integrity != "ok":
        report.problems.append(f"integrity_check failed: {report.integrity}")
    if report.contents == "foreign":
        report.problems.append(
            f"the file holds another program's tables (application_id {app_id:#x}, "
            f"nulltickets' is {connection.APPLICATION_ID:#x})"
        )
    if report.wal_bytes and report.in_use is False:
        report.notes.append(
            "a WAL file is left by a process that ended without closing the database; "
            "the next start replays it"
        )
    if version > expected:
        return _refuse(
            report,
            f"schema version {version} is newer than this nulltickets ({expected}): "
            "run the newer version",
        )
    if not os.access(report.path, os.W_OK) or not os.access(
        Path(report.path).absolute().parent, os.W_OK
    ):
        return _refuse(report, f"{report.path} or its directory is not writable")
    if version == expected:
        report.on_start = "nothing to migrate: serve it as it is"
    elif report.contents == "original":
        report.on_start = f"adopt the original's database and migrate it from 0 to {expected}"
    else:
        report.on_start = f"migrate from version {version} to {expected}"
    report.ok = not report.problems
    return report


def _contents(version: int, app_id: int, tables: set[str]) -> str:
    if app_id == connection.APPLICATION_ID:
        return "nulltickets"
    if app_id != 0:
        return "foreign"
    if version == 0 and "pipelines" in tables:
        return "original"
    return "empty" if not tables else ("nulltickets" if version else "foreign")


def _refuse(report: DoctorReport, reason: str) -> DoctorReport:
    report.on_start = f"refuse to start: {reason}"
    report.problems.append(reason)
    report.ok = False
    return report


def _integrity(conn: apsw.Connection) -> str:
    rows = [str(row[0]) for row in conn.execute("PRAGMA integrity_check(10)")]
    return "ok" if rows == ["ok"] else "; ".join(rows)


def in_use(path: str) -> bool | None:
    """Whether another process has the WAL database at `path` open (None: cannot tell here).

    It asks the kernel who holds the lock every connection keeps on the -shm file, without
    taking it. POSIX locks belong to a process and closing any descriptor of a file drops all
    of them, so call this before this process opens the database itself.
    """
    shm = path + "-shm"
    if not os.path.exists(shm):
        return False
    try:
        import fcntl
    except ImportError:  # Windows
        return None
    if sys.platform.startswith("linux"):
        layout = "hhxxxxqqixxxx"  # l_type, l_whence, l_start, l_len, l_pid
        request = struct.pack(layout, fcntl.F_WRLCK, os.SEEK_SET, _SHM_DMS, 1, 0)
        type_index = 0
    elif sys.platform == "darwin":
        layout = "qqihh"  # l_start, l_len, l_pid, l_type, l_whence
        request = struct.pack(layout, _SHM_DMS, 1, 0, fcntl.F_WRLCK, os.SEEK_SET)
        type_index = 3
    else:
        return None
    try:
        fd = os.open(shm, os.O_RDONLY)
    except OSError:
        return None
    try:
        answer = fcntl.fcntl(fd, fcntl.F_GETLK, request)
    except OSError:
        return None
    finally:
        os.close(fd)
    return bool(struct.unpack(layout, answer)[type_index] != fcntl.F_UNLCK)
