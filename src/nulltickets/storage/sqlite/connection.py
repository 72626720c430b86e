"""Opening connections: small named steps, each one setting one thing."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import apsw

from nulltickets.errors import StartupError, StorageReadOnly

MIN_SQLITE = (3, 51, 0)
APPLICATION_ID = 0x4E544B54  # "NTKT": marks files nulltickets has migrated
BUSY_TIMEOUT_MS = 5000
DURABILITY = {"full": "FULL", "normal": "NORMAL"}
# PRAGMA auto_vacuum's value for INCREMENTAL: the file keeps what it needs to give free pages
# back (PRAGMA incremental_vacuum). It can only be chosen before the first table exists; a
# file made before that needs one VACUUM to switch (`nulltickets prune --vacuum`).
INCREMENTAL_VACUUM = 2
# apsw puts a statement back into its cache at a rotating slot, evicting whatever sits there.
# With its default 100 slots the twenty-odd statements of the claim cycle evicted each other
# about once every three cycles, and each eviction meant parsing and planning the statement
# again (measured: 6,800 re-prepares in 20,000 cycles). With 512 slots they stay prepared.
STATEMENT_CACHE = 512
# Tests only: names the options of the power-cut VFS (powercut_vfs.py), which every connection
# then goes through. Unset, as it always is outside the reliability suites, nothing of it runs.
TEST_POWERCUT_VFS = "NULLTICKETS_TEST_POWERCUT_VFS"


# The compile options worth reporting (/health, the start line): what the build chose
# (build/sqlite-options.txt), not the limits and defaults SQLite lists besides.
REPORTED_OPTION_PREFIXES = ("ENABLE_", "OMIT_", "DQS=", "THREADSAFE=", "DEFAULT_MEMSTATUS=",
                            "LIKE_DOESNT_MATCH_BLOBS")  # fmt: skip


def sqlite_version() -> str:
    return str(apsw.sqlite_lib_version())


def sqlite_options() -> list[str]:
    """The SQLite library's chosen compile options, sorted (e.g. "DQS=0", "ENABLE_FTS5")."""
    return sorted(o for o in apsw.compile_options if o.startswith(REPORTED_OPTION_PREFIXES))


def check_sqlite() -> None:
    """Refuse to run on an SQLite that lacks what the schema needs."""
    version = tuple(int(p) for p in apsw.sqlite_lib_version().split(".")[:3])
    if version < MIN_SQLITE:
        raise StartupError(f"SQLite {apsw.sqlite_lib_version()} is too old; 3.51 or newer needed")
    if "ENABLE_FTS5" not in apsw.compile_options:
        raise StartupError("this SQLite was built without FTS5")


def _test_vfs(path: str) -> str | None:
    spec = os.environ.get(TEST_POWERCUT_VFS)
    if not spec or path == ":memory:":
        return None
    from nulltickets.storage.sqlite import powercut_vfs  # tests only: see the module

    return powercut_vfs.install(spec)


def _open(path: str, flags: int) -> apsw.Connection:
    try:
        return apsw.Connection(
            path, flags=flags, statementcachesize=STATEMENT_CACHE, vfs=_test_vfs(path)
        )
    except apsw.CantOpenError as exc:
        raise StartupError(f"cannot open database {path!r}: {exc}") from exc


@contextlib.contextmanager
def opening(path: str) -> Iterator[None]:
    """The driver's start-up failures as ours, each naming the file (the CLI prints one line)."""
    try:
        yield
    except apsw.NotADBError:
        raise StartupError(f"{path} is not an SQLite database") from None
    except apsw.CorruptError as exc:
        raise StartupError(
            f"database {path} is corrupt ({exc}); restore it from a backup"
        ) from None
    except apsw.ReadOnlyError:
        raise StorageReadOnly(f"database {path} is read-only") from None
    except apsw.CantOpenError as exc:
        raise StartupError(f"cannot open database {path}: {exc}") from None
    except (apsw.IOError, apsw.PermissionsError, apsw.AuthError) as exc:
        raise StartupError(f"cannot use database {path}: {exc}") from None


def _base_pragmas(conn: apsw.Connection) -> None:
    conn.set_busy_timeout(BUSY_TIMEOUT_MS)
    conn.pragma("foreign_keys", True)
    conn.pragma("temp_store", "MEMORY")
    conn.pragma("cache_size", -16000)
    # Double-quoted strings must be identifiers, never string literals.
    conn.config(apsw.SQLITE_DBCONFIG_DQS_DML, 0)
    conn.config(apsw.SQLITE_DBCONFIG_DQS_DDL, 0)


def connect_writer(path: str, durability: str = "full") -> apsw.Connection:
    """The one read-write connection. `with conn:` opens BEGIN IMMEDIATE."""
    conn = _open(path, apsw.SQLITE_OPEN_READWRITE | apsw.SQLITE_OPEN_CREATE | apsw.SQLITE_OPEN_URI)
    with opening(path):
        _base_pragmas(conn)
        if int(conn.pragma("page_count")) == 0:
            # A new file, before WAL mode writes its first page: give pages back to the file
            # system as retention frees them.
            conn.pragma("auto_vacuum", INCREMENTAL_VACUUM)
        mode = conn.pragma("journal_mode", "wal")
        if conn.readonly("main"):  # a read-only file system or a `file:...?mode=ro` URI
            raise apsw.ReadOnlyError("read-only")
    if path != ":memory:" and str(mode).lower() != "wal":
        raise StartupError(f"cannot switch {path!r} to WAL mode (got {mode!r})")
    conn.pragma("synchronous", DURABILITY[durability])
    conn.transaction_mode = "IMMEDIATE"
    return conn


def connect_reader(path: str) -> apsw.Connection:
    conn = _open(path, apsw.SQLITE_OPEN_READONLY | apsw.SQLITE_OPEN_URI)
    _base_pragmas(conn)
    return conn


def ensure_parent(path: str) -> None:
    if path == ":memory:" or path.startswith("file:"):
        return
    parent = Path(path).expanduser().absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise StartupError(f"cannot create the database directory {parent}: {reason}") from None


def check_writable(path: str) -> None:
    """A read-only file or directory is a start-up error, not a failure on the first write."""
    if path == ":memory:" or path.startswith("file:"):
        return
    p = Path(path)
    if p.exists() and not os.access(p, os.W_OK):
        raise StorageReadOnly(f"database file {path!r} is not writable")
    if not os.access(p.absolute().parent, os.W_OK):
        raise StorageReadOnly(f"directory of {path!r} is not writable (WAL needs it)")


# --- migrations --------------------------------------------------------------------------------


def migrations() -> list[tuple[int, str, str]]:
    """(number, name, sql) of every migration, in order."""
    folder = resources.files("nulltickets.storage.sqlite").joinpath("migrations")
    found = []
    for entry in folder.iterdir():
        if entry.name.endswith(".sql"):
            number = int(entry.name.split("_", 1)[0])
            found.append((number, entry.name, entry.read_text("utf-8")))
    found.sort()
    if [n for n, _, _ in found] != list(range(1, len(found) + 1)):
        raise StartupError("migrations must be numbered 1..N without gaps")
    return found


def migrate(conn: apsw.Connection) -> int:
    """Apply every migration newer than the database's user_version; return the new version.

    Each migration runs in its own transaction together with its user_version bump.
    """
    with opening(conn.filename or ":memory:"):
        return _migrate(conn)


def _migrate(conn: apsw.Connection) -> int:
    current = conn.pragma("user_version")
    known = migrations()
    if current > len(known):
        raise StartupError(
            f"database schema version {current} is newer than this nulltickets ({len(known)})"
        )
    if current == 0 and conn.table_exists("main", "pipelines"):
        _adopt_reference_database(conn)
    for number, _name, sql in known[current:]:
        with conn:
            conn.execute(sql).fetchall()  # apsw runs statements lazily: drain them all
            conn.pragma("user_version", number)
            conn.pragma("application_id", APPLICATION_ID)
    return len(known)


def _adopt_reference_database(conn: apsw.Connection) -> None:
    """A file the original created has our tables but its own store triggers, whose names we
    cannot know; drop them (migration 0002 rebuilds the full-text index and its triggers)."""
    triggers = conn.execute(
        "SELECT name FROM sqlite_schema WHERE type = 'trigger' AND tbl_name = 'store'"
    ).fetchall()
    with conn:
        for (name,) in triggers:
            quoted = str(name).replace('"', '""')
            conn.execute(f'DROP TRIGGER "{quoted}"')
