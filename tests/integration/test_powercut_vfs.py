"""The test-only power-cut VFS (storage/sqlite/powercut_vfs.py) on real files: what it keeps in
memory, what reaches the file, and what a cut leaves behind. The reliability suites rely on it
(tests/reliability/test_power_cut.py), so it is checked here on its own first."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import apsw
import pytest

from nulltickets.storage.sqlite import connection
from nulltickets.storage.sqlite.powercut_vfs import ENV, Options, PowercutVFS

_names = itertools.count()
DB_FLAGS = apsw.SQLITE_OPEN_READWRITE | apsw.SQLITE_OPEN_CREATE | apsw.SQLITE_OPEN_MAIN_DB
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def make_vfs() -> Iterator[object]:
    made: list[PowercutVFS] = []

    def make(spec: str = "on") -> PowercutVFS:
        vfs = PowercutVFS(Options.parse(spec), name=f"powercut-test-{next(_names)}")
        made.append(vfs)
        return vfs

    yield make
    for vfs in made:
        vfs.unregister()


def open_file(vfs: PowercutVFS, path: Path) -> apsw.VFSFile:
    return vfs.xOpen(str(path), [DB_FLAGS, 0])


def page(byte: bytes) -> bytes:
    return byte * 4096


def test_unsynced_writes_are_read_back_but_vanish_in_a_cut_and_synced_ones_stay(
    tmp_path: Path, make_vfs
) -> None:  # type: ignore[no-untyped-def]
    vfs = make_vfs()
    path = tmp_path / "f.db"
    f = open_file(vfs, path)
    f.xWrite(page(b"A"), 0)
    f.xSync(apsw.SQLITE_SYNC_NORMAL)
    f.xWrite(page(b"B"), 4096)
    f.xWrite(b"CC", 10)  # over a synced page, unaligned
    # This process reads its own writes, as through the page cache...
    assert f.xFileSize() == 8192
    assert f.xRead(8192, 0) == b"A" * 10 + b"CC" + b"A" * 4084 + page(b"B")
    # ...the file has only what was synced...
    assert path.read_bytes() == page(b"A")
    report = vfs.simulate_cut("test")
    # ...and a cut (no tear, no reorder: like a SIGKILL) loses every unsynced write.
    assert path.read_bytes() == page(b"A")
    assert report["files"][str(path)] == {"kind": "db", "pending": 2, "kept": 0, "torn_to": None}
    f.xClose()  # after the cut nothing reaches the file any more, not even at close
    assert path.read_bytes() == page(b"A")


def test_a_clean_close_writes_the_pending_writes_through(tmp_path: Path, make_vfs) -> None:  # type: ignore[no-untyped-def]
    vfs = make_vfs()
    path = tmp_path / "f.db"
    f = open_file(vfs, path)
    g = open_file(vfs, path)  # a second handle (another connection) shares the overlay
    f.xWrite(page(b"A"), 0)
    assert g.xRead(4096, 0) == page(b"A")
    f.xClose()
    assert path.read_bytes() == b""  # g still has it open: still only in memory
    g.xClose()
    assert path.read_bytes() == page(b"A")


def test_truncate_is_pending_until_synced(tmp_path: Path, make_vfs) -> None:  # type: ignore[no-untyped-def]
    vfs = make_vfs()
    path = tmp_path / "f.db"
    path.write_bytes(page(b"A") + page(b"B"))
    f = open_file(vfs, path)
    f.xTruncate(4096 + 100)
    assert f.xFileSize() == 4196
    f.xWrite(b"Z", 4096 + 200)  # past the cut-off end: the gap reads as zeros, not as old B's
    assert f.xRead(200, 4096) == b"B" * 100 + bytes(100)
    assert len(path.read_bytes()) == 8192
    f.xSync(0)
    assert path.read_bytes() == page(b"A") + b"B" * 100 + bytes(100) + b"Z"
    f.xClose()


def test_a_torn_cut_keeps_writes_in_order_and_a_prefix_of_the_last(
    tmp_path: Path, make_vfs
) -> None:  # type: ignore[no-untyped-def]
    torn_partly = 0
    for seed in range(20):
        vfs = make_vfs(f"tear,seed={seed}")
        path = tmp_path / f"f{seed}.db"
        f = open_file(vfs, path)
        writes = [page(bytes([65 + i])) for i in range(5)]
        for i, data in enumerate(writes):
            f.xWrite(data, i * 4096)
        report = vfs.simulate_cut("test")["files"][str(path)]
        kept, torn = report["kept"], report["torn_to"]
        assert 1 <= kept <= 5 and torn is not None
        assert path.read_bytes() == b"".join(writes[: kept - 1]) + writes[kept - 1][:torn]
        torn_partly += torn > 0
        f.xClose()
    assert torn_partly  # some cut left part of a page, not only whole ones or nothing


def test_a_reordering_cut_keeps_any_subset_of_the_pending_writes(tmp_path: Path, make_vfs) -> None:  # type: ignore[no-untyped-def]
    patterns = set()
    for seed in range(20):
        vfs = make_vfs(f"reorder,seed={seed}")
        path = tmp_path / f"f{seed}.db"
        path.write_bytes(bytes(5 * 4096))
        f = open_file(vfs, path)
        for i in range(5):
            f.xWrite(page(bytes([65 + i])), i * 4096)
        vfs.simulate_cut("test")
        data = path.read_bytes()
        pages = [data[i * 4096 : (i + 1) * 4096] for i in range(5)]
        for i, got in enumerate(pages):
            assert got in (bytes(4096), page(bytes([65 + i]))), (seed, i)
        patterns.add(tuple(got != bytes(4096) for got in pages))
        f.xClose()
    # Not a prefix: some cut kept a later write and lost an earlier one.
    assert any(p != tuple(sorted(p, reverse=True)) for p in patterns), patterns


def test_a_lying_disk_never_writes_through_on_sync(tmp_path: Path, make_vfs) -> None:  # type: ignore[no-untyped-def]
    vfs = make_vfs("lying")
    path = tmp_path / "f.db"
    f = open_file(vfs, path)
    f.xWrite(page(b"A"), 0)
    f.xSync(apsw.SQLITE_SYNC_FULL)
    assert f.xRead(4096, 0) == page(b"A")
    assert path.read_bytes() == b""
    vfs.simulate_cut("test")
    assert path.read_bytes() == b""
    f.xClose()


def test_the_options_are_checked() -> None:
    assert Options.parse("tear,reorder,seed=3,cut-at=wal:7:nulltickets-checkpointer") == Options(
        tear=True, reorder=True, seed=3, cut_at=("wal", 7, "nulltickets-checkpointer")
    )
    for bad in ("lie", "cut-at=db", "cut-at=log:3", "cut-at=db:0"):
        with pytest.raises(ValueError):
            Options.parse(bad)


# --- SQLite on it, in a process of its own that dies: what survives ---------------------------

CHILD = """
import os, signal, sys
from nulltickets.storage.sqlite import connection
path, durability, rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
conn = connection.connect_writer(path, durability)
conn.execute("CREATE TABLE IF NOT EXISTS t (i INTEGER PRIMARY KEY, v TEXT)")
for i in range(rows):
    with conn:
        conn.execute("INSERT INTO t (v) VALUES (?)", ("x" * 300,))
    print("committed", flush=True)
# Another connection of the process reads what the writer committed, synced or not.
reader = connection.connect_reader(path)
print("reader", reader.execute("SELECT count(*) FROM t").fetchone()[0], flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def run_child(path: Path, durability: str, spec: str | None, rows: int = 200) -> tuple[int, int]:
    """(commits the child was told about, rows its reader saw: -1 if it died first)."""
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if spec is not None:
        env[ENV] = spec
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), durability, str(rows)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == -9, out.stderr
    if spec is not None:
        assert f"TEST ONLY: {ENV}" in out.stderr  # the switch says loudly that it is on
    lines = out.stdout.split("\n")
    seen = [int(line.split()[1]) for line in lines if line.startswith("reader")]
    return lines.count("committed"), seen[0] if seen else -1


def committed_rows(path: Path) -> int:
    conn = apsw.Connection(str(path))  # the default VFS: what is really in the files
    try:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        if not conn.table_exists("main", "t"):
            return 0
        return int(conn.execute("SELECT count(*) FROM t").fetchone()[0])
    finally:
        conn.close()


def test_without_the_switch_a_sigkill_loses_no_commit_in_either_mode(tmp_path: Path) -> None:
    for durability in ("full", "normal"):
        path = tmp_path / f"{durability}.db"
        assert run_child(path, durability, None) == (200, 200)
        assert committed_rows(path) == 200


def test_on_the_vfs_full_keeps_every_commit_and_normal_loses_the_unsynced_ones(
    tmp_path: Path,
) -> None:
    assert run_child(tmp_path / "full.db", "full", "on") == (200, 200)
    assert committed_rows(tmp_path / "full.db") == 200
    # NORMAL syncs the WAL only at checkpoints, and 200 small commits do not reach one.
    assert run_child(tmp_path / "normal.db", "normal", "on") == (200, 200)
    assert committed_rows(tmp_path / "normal.db") == 0


def test_on_a_lying_disk_even_full_loses_commits(tmp_path: Path) -> None:
    assert run_child(tmp_path / "lying.db", "full", "lying") == (200, 200)
    assert committed_rows(tmp_path / "lying.db") == 0


@pytest.mark.parametrize("durability", ["full", "normal"])
def test_a_torn_reordered_cut_while_the_wal_is_written_never_corrupts_the_file(
    tmp_path: Path, durability: str
) -> None:
    """Cut at a write to the WAL in the middle of the run, tearing and reordering what was
    pending: with full every commit the child heard of is in the file, with normal some are
    not; the file passes integrity_check either way (committed_rows checks it)."""
    for seed in range(4):
        path = tmp_path / f"cut{seed}.db"
        spec = f"tear,reorder,seed={seed},cut-at=wal:{150 + 37 * seed}"
        acked, seen = run_child(path, durability, spec)
        assert seen == -1 and 0 < acked < 200, (acked, seen)  # the cut came mid-run
        survived = committed_rows(path)
        if durability == "full":
            assert survived == acked, seed
        else:
            assert survived <= acked, seed


def test_connection_opens_plain_files_without_the_switch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    conn = connection.connect_writer(str(tmp_path / "plain.db"))
    try:
        assert conn.vfsname("main") == "unix"
    finally:
        conn.close()
