"""Suite 6, faults: a full disk (a size-limited tmpfs where the machine allows mounting, and a
file-size limit, RLIMIT_FSIZE, on the server process), a database locked by another process for
10 s, and a read-only database file. Writes must fail with a clear JSON 507/503, reads keep being
served, nothing hangs, nothing acknowledged is lost, nothing is corrupted, and the server works
again once the fault is gone; a read-only file is a clear error at start-up."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.reliability.helpers import assert_storage_healthy, envelope, open_db, rows
from tests.reliability.report import Recorder, scale
from tests.server import Client, Response, Server, _children, free_port, server_command

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(sys.platform != "linux", reason="faults are injected with Linux tools"),
]

BUSY_TIMEOUT_S = 5.0
LOCK_S = 10.0
BIG = "y" * 30_000


# --- a full disk -------------------------------------------------------------------------------


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


class Disk:
    """Fills up and frees the disk under a server: a filler file on a small tmpfs, or a file
    size limit (soft RLIMIT_FSIZE) on the server's processes at the size the files have now."""

    def __init__(self, kind: str, server: Server, folder: Path) -> None:
        self.kind = kind
        self.server = server
        self.folder = folder
        self.filler = folder / "filler"

    def fill(self) -> None:
        if self.kind == "tmpfs":
            with open(self.filler, "wb") as f, contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
        else:
            files = [p for p in self.folder.glob(self.server.db.name + "*") if p.is_file()]
            limit = max(p.stat().st_size for p in files)
            self._limit(limit)

    def free(self) -> None:
        if self.kind == "tmpfs":
            self.filler.unlink()
        else:
            self._limit(resource.RLIM_INFINITY)

    def _limit(self, soft: int) -> None:
        assert self.server.proc is not None
        for pid in [self.server.proc.pid, *_children(self.server.proc.pid)]:
            _, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (soft, hard))


@dataclass
class FullDisk:
    """What a full-disk scenario saw."""

    acked: dict[str, Any] = field(default_factory=dict)  # store key -> value, acknowledged
    refused: list[str] = field(default_factory=list)  # store keys whose PUT was refused
    write_answers: Counter[str] = field(default_factory=Counter)
    read_answers: Counter[int] = field(default_factory=Counter)
    bad_writes: list[str] = field(default_factory=list)  # refusals that were not 507/503
    retry_after: set[str] = field(default_factory=set)
    recovered_after: int = 0


@contextlib.contextmanager
def disk_server(kind: str, tmp_path: Path) -> Iterator[tuple[Server, Disk]]:
    if kind == "tmpfs":
        with tmpfs(tmp_path / "mnt", "6m") as folder:
            server = Server(folder / "full.db")
            server.log = tmp_path / "full.log"  # the log must not fill up with the disk
            yield server.start(), Disk(kind, server, folder)
            server.kill()
    else:
        server = Server(tmp_path / "full.db").start()
        yield server, Disk(kind, server, tmp_path)
        server.kill()


def put(client: Client, key: str, value: Any) -> Response:
    return client.put(f"/store/full/{key}", {"value": value})


def run_full_disk(kind: str, tmp_path: Path, writes_while_full: int) -> FullDisk:
    seen = FullDisk()
    with disk_server(kind, tmp_path) as (server, disk):
        c = server.client()
        r = c.post(
            "/pipelines",
            {
                "name": "full",
                "definition": {
                    "initial": "a",
                    "states": {"a": {"agent_role": "r"}, "b": {"terminal": True}},
                    "transitions": [{"from": "a", "to": "b", "trigger": "go"}],
                },
            },
        )
        assert r.status == 201, r.body
        task = c.post("/tasks", {"pipeline_id": r.json["id"], "title": "t", "description": ""})
        assert task.status == 201
        for i in range(5):
            value = {"n": i, "text": f"before the disk filled {i}"}
            assert put(c, f"before-{i}", value).status == 204
            seen.acked[f"before-{i}"] = value

        disk.fill()
        # Write until the disk says no (a write may still fit in space SQLite already has);
        # after that, every write must be refused cleanly.
        refusals = 0
        for i in range(400):
            key = f"during-{i}"
            r = put(c, key, {"n": i, "text": BIG})
            if r.status == 204:
                assert refusals == 0, "a write succeeded between refusals"
                seen.acked[key] = {"n": i, "text": BIG}
                continue
            refusals += 1
            seen.refused.append(key)
            code = envelope(r) if r.status >= 400 else "?"
            seen.write_answers[f"{r.status} {code}"] += 1
            if r.status not in (503, 507):
                seen.bad_writes.append(f"{r.status} {code}")
            if "retry-after" in r.headers:
                seen.retry_after.add(r.headers["retry-after"])
            for path in (
                "/health",
                f"/tasks/{task.json['id']}",
                "/store/full/before-0",
                "/store/search?q=disk",
            ):
                seen.read_answers[c.get(path).status] += 1
            if refusals >= writes_while_full:
                break
        assert refusals, f"the disk never filled up ({kind})"
        assert server.proc is not None and server.proc.poll() is None, server.output()

        disk.free()
        for attempt in range(50):
            value = {"n": attempt, "text": "after the space came back"}
            r = put(c, f"after-{attempt}", value)
            if r.status == 204:
                seen.acked[f"after-{attempt}"] = value
                seen.recovered_after = attempt
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"writes still refused after the space came back: {r.body!r}")
        for i in range(3):
            value = {"n": i, "text": "and more"}
            assert put(c, f"later-{i}", value).status == 204
            seen.acked[f"later-{i}"] = value
        c.close()
        assert server.stop() in (0, -15, 143)

        assert_storage_healthy(server.db)
        with open_db(server.db) as conn:
            stored = {
                k: json.loads(v)
                for k, v in rows(conn, "SELECT key, value_json FROM store WHERE namespace = 'full'")
            }
        lost = {k for k, v in seen.acked.items() if stored.get(k) != v}
        assert lost == set(), f"acknowledged writes lost: {sorted(lost)[:10]}"
        ghosts = [k for k in seen.refused if k in stored]
        assert ghosts == [], f"refused writes were stored anyway: {ghosts[:10]}"

        # And the file opens again in a fresh server with everything in it.
        server.start()
        c = server.client()
        assert c.get("/store/full/later-2").json["value"] == {"n": 2, "text": "and more"}
        c.close()
        server.stop()
    return seen


FULL_KINDS = ["tmpfs", "RLIMIT_FSIZE"]
WHAT = {
    "tmpfs": "database on a size-limited tmpfs filled up by another file",
    "RLIMIT_FSIZE": "a file-size limit (RLIMIT_FSIZE) on the server process at the size of its "
    "files",
}


@pytest.mark.parametrize("kind", FULL_KINDS)
@pytest.mark.timeout(120)
def test_a_full_disk_refuses_writes_keeps_reads_and_recovers_uncorrupted(
    kind: str, tmp_path: Path, record: Recorder
) -> None:
    writes = scale(20, 300)
    row = record(
        "faults",
        f"full disk: {WHAT[kind]}: reads keep working, nothing acknowledged is lost, no refused "
        "write is half-stored, nothing is corrupted, writes work again once space is freed",
        0,
        "writes refused",
    )
    seen = run_full_disk(kind, tmp_path, writes)
    row.tried = sum(seen.write_answers.values())
    row.detail = (
        f"writes answered {dict(seen.write_answers)} (Retry-After {sorted(seen.retry_after)}); "
        f"reads meanwhile {dict(seen.read_answers)}; writes worked again "
        f"{'at once' if not seen.recovered_after else f'after {seen.recovered_after} tries'} "
        f"once space was back; {len(seen.acked)} acknowledged writes kept, "
        f"{len(seen.refused)} refused ones absent; integrity, foreign keys and FTS5 ok"
    )
    assert set(seen.read_answers) == {200}, seen.read_answers
    assert all(s.split()[0].isdigit() and int(s.split()[0]) >= 400 for s in seen.write_answers)


@pytest.mark.parametrize(
    "kind",
    [
        "tmpfs",
        "RLIMIT_FSIZE",
    ],
)
@pytest.mark.timeout(120)
def test_writes_on_a_full_disk_get_a_clear_507_or_503(
    kind: str, tmp_path: Path, record: Recorder
) -> None:
    row = record("faults", f"full disk ({kind}): every refused write is 507/503", 0, "writes")
    seen = run_full_disk(kind, tmp_path, 5)
    row.tried = sum(seen.write_answers.values())
    row.detail = f"answers {dict(seen.write_answers)}"
    assert seen.bad_writes == [], seen.write_answers
    assert seen.retry_after, "no Retry-After on the refusals"


# --- a database locked by another process ------------------------------------------------------

LOCKER = """
import sys, time, apsw
conn = apsw.Connection(sys.argv[1])
conn.set_busy_timeout(30000)
conn.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
conn.execute("ROLLBACK")
conn.close()
print("released", flush=True)
"""


@dataclass
class Timed:
    kind: str
    sent: float
    took: float
    status: int
    retry_after: str | None
    code: str


@dataclass
class Locked:
    """What one lock scenario saw: every answer, then the state after the release."""

    answers: list[Timed]
    after_release_s: float
    stored: set[str]
    health: dict[str, Any]


@pytest.fixture(scope="module")
def locked(tmp_path_factory: pytest.TempPathFactory) -> Locked:
    """Hold the write lock from another process for LOCK_S while 3 writers and a reader keep
    sending; then one write after the release, a clean stop and the file's checks. Run once for
    the module's two tests."""
    server = Server(tmp_path_factory.mktemp("locked") / "locked.db").start()
    try:
        c = server.client()
        assert c.put("/store/lock/before", {"value": 1}).status == 204
        locker = subprocess.Popen(
            [sys.executable, "-c", LOCKER, str(server.db), str(LOCK_S)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert locker.stdout is not None
        assert locker.stdout.readline().strip() == "locked"
        locked_at = time.monotonic()
        answers: list[Timed] = []
        lock = threading.Lock()

        def worker(kind: str, n: int) -> None:
            own = Client("127.0.0.1", server.port, timeout=60)
            i = 0
            while time.monotonic() - locked_at < LOCK_S + 1:
                sent = time.monotonic()
                if kind == "write":
                    r = own.put(f"/store/lock/w{n}-{i}", {"value": i})
                else:
                    r = own.get("/store/lock/before")
                took = time.monotonic() - sent
                code = envelope(r) if r.status >= 400 else ""
                retry = r.headers.get("retry-after")
                with lock:
                    answers.append(Timed(kind, sent - locked_at, took, r.status, retry, code))
                i += 1
                time.sleep(0.2)
            own.close()

        threads = [threading.Thread(target=worker, args=("write", n)) for n in range(3)]
        threads.append(threading.Thread(target=worker, args=("read", 0)))
        for t in threads:
            t.start()
        for t in threads:
            t.join(LOCK_S + BUSY_TIMEOUT_S * 3 + 30)
        assert locker.stdout.readline().strip() == "released"
        locker.wait(10)
        locker.stdout.close()

        start = time.monotonic()
        assert c.put("/store/lock/after", {"value": 2}).status == 204
        after_release = time.monotonic() - start
        c.close()
        assert server.stop() in (0, -15, 143)
        health = assert_storage_healthy(server.db)
        with open_db(server.db) as conn:
            stored = {k for (k,) in rows(conn, "SELECT key FROM store WHERE namespace = 'lock'")}
        return Locked(answers, after_release, stored, health)
    finally:
        server.kill()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_database_locked_for_10s_gets_503_retry_after_and_never_hangs(
    locked: Locked, record: Recorder
) -> None:
    row = record(
        "faults",
        f"another process holds the database's write lock for {LOCK_S:.0f} s while 3 writers "
        "and a reader keep sending",
        len(locked.answers),
        "requests",
    )
    answers = locked.answers
    worst = max(a.took for a in answers)
    writes = [a for a in answers if a.kind == "write"]
    busy = [a for a in writes if a.status == 503]
    kept = [a for a in writes if a.status == 204]
    reads = [a.took for a in answers if a.kind == "read"]
    row.detail = (
        f"{len(busy)} writes 503 storage_busy with Retry-After, {len(kept)} went through "
        f"after the lock; the slowest answer took {worst:.1f} s (lock {LOCK_S:.0f} s, busy "
        f"timeout {BUSY_TIMEOUT_S:.0f} s); reads all 200, slowest {max(reads):.1f} s; a write "
        f"right after the release took {locked.after_release_s:.2f} s; integrity ok"
    )
    assert all(a.status in (204, 503) for a in writes), Counter(a.status for a in writes)
    assert all(a.code == "storage_busy" and a.retry_after for a in busy), busy[:3]
    assert busy, "no write was refused while the database was locked"
    assert all(a.status == 200 for a in answers if a.kind == "read")
    # Nothing hangs: at worst the lock plus one busy timeout plus slack.
    assert worst < LOCK_S + BUSY_TIMEOUT_S + 5, worst
    assert locked.after_release_s < 2
    # What was acknowledged is there; what was refused is not.
    assert {"before", "after"} <= locked.stored
    assert len(locked.stored) == 2 + len(kept), (len(locked.stored), len(kept))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_while_locked_writes_get_503_within_the_busy_timeout_and_reads_flow(
    locked: Locked, record: Recorder
) -> None:
    row = record(
        "faults",
        f"database locked for {LOCK_S:.0f} s: each write answered within the busy timeout, "
        "reads within 1 s",
        len(locked.answers),
        "requests",
    )
    writes = [a for a in locked.answers if a.kind == "write"]
    reads = [a for a in locked.answers if a.kind == "read"]
    slow_writes = [a for a in writes if a.took > BUSY_TIMEOUT_S + 1.5]
    slow_reads = [a for a in reads if a.took > 1.0]
    row.detail = (
        f"{len(slow_writes)} writes slower than {BUSY_TIMEOUT_S + 1.5:.1f} s (max "
        f"{max(a.took for a in writes):.1f} s), {len(slow_reads)} reads slower than 1 s (max "
        f"{max(a.took for a in reads):.1f} s)"
    )
    assert slow_writes == [] and slow_reads == [], row.detail


# --- a read-only database ----------------------------------------------------------------------

PR_CAPBSET_DROP = 24
CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER, CAP_LINUX_IMMUTABLE = 1, 2, 3, 9


def without_root_overrides() -> None:
    """preexec_fn: root keeps its uid but loses the capabilities that ignore file modes."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER, CAP_LINUX_IMMUTABLE):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def make_database(path: Path) -> None:
    server = Server(path).start()
    c = server.client()
    assert c.put("/store/ro/k", {"value": 1}).status == 204
    c.close()
    server.stop()


def start_expecting_failure(db: Path, home: Path) -> tuple[int, str, float]:
    port = free_port()
    cmd = [*server_command(), "serve", "--port", str(port), "--db", str(db)]
    env = {**os.environ, "NULLTICKETS_HOME": str(home)}
    started = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=without_root_overrides if os.geteuid() == 0 else None,
    )
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"the server started on a read-only database:\n{err}") from None
    return proc.returncode, err, time.monotonic() - started


@contextlib.contextmanager
def read_only(case: str, tmp_path: Path) -> Iterator[Path]:
    """A database the server cannot write, in one of several ways."""
    folder = tmp_path / case.replace(" ", "-")
    folder.mkdir()
    db = folder / "ro.db"
    if case == "a read-only file":
        make_database(db)
        db.chmod(0o444)
        yield db
    elif case == "a read-only directory":
        make_database(db)
        folder.chmod(0o555)
        try:
            yield db
        finally:
            folder.chmod(0o755)
    elif case == "a new file in a read-only directory":
        folder.chmod(0o555)
        try:
            yield db
        finally:
            folder.chmod(0o755)
    else:  # a read-only file system
        with tmpfs(folder / "mnt", "4m") as mnt:
            db = mnt / "ro.db"
            make_database(db)
            remount = subprocess.run(
                ["mount", "-o", "remount,ro", str(mnt)], capture_output=True, text=True, check=False
            )
            if remount.returncode != 0:
                pytest.skip(f"cannot remount read-only: {remount.stderr.strip()}")
            yield db


RO_CASES = [
    "a read-only file",
    "a read-only directory",
    "a new file in a read-only directory",
    "a read-only file system",
]


@pytest.mark.parametrize("case", RO_CASES)
def test_a_read_only_database_is_a_clear_error_at_start_up(
    case: str, tmp_path: Path, record: Recorder
) -> None:
    row = record(
        "faults",
        "start on a read-only database (file 0444, directory 0555, new file in a 0555 directory, "
        "read-only mount; root loses CAP_DAC_OVERRIDE first)",
        1,
        "start-ups",
    )
    home = tmp_path / "home"
    home.mkdir()
    with read_only(case, tmp_path) as db:
        before = db.read_bytes() if db.exists() else None
        code, err, took = start_expecting_failure(db, home)
        assert code != 0, err
        message = err.strip().splitlines()[-1] if err.strip() else ""
        assert "Traceback" not in err, err
        assert str(db) in message or db.name in message, err
        assert any(w in message.lower() for w in ("read-only", "not writable", "readonly")), err
        assert took < 20
        if before is not None:
            assert db.read_bytes() == before  # untouched
    row.detail = "each one exited non-zero at once with one line naming the file and saying why"
    row.extra.setdefault("messages", []).append(message)
