"""Suite 7, power cuts: the server crash suite's load and invariants on the power-cut VFS
(src/nulltickets/storage/sqlite/powercut_vfs.py, selected with NULLTICKETS_TEST_POWERCUT_VFS),
where a SIGKILL takes with it every write not yet synced, as a power cut takes the page cache.

Each cycle cuts the server one of three ways, in turn: a SIGKILL from outside (nothing unsynced
survives); a cut the VFS makes itself at the next write, keeping a random subset of the pending
writes in random order and tearing the last (as a disk with a write cache may); and such a cut
in the middle of a background checkpoint (at a write of the checkpointer thread to the database
file). Then the server restarts on the same files.

- `--durability full`: nothing an agent was told succeeded is lost, nothing is done twice, every
  integrity check passes.
- `--durability normal`: the file is never corrupt and the invariants hold; the acknowledged
  writes a cut loses are counted, with how long before the cut they were acknowledged.
- A disk that lies (ignores xSync): the same check reports lost acknowledged writes, which is
  what proves it can see them.
- Cuts during the writer's own copy-back of the WAL, and during the migration of an old file at
  start.

`make test` runs 3 cuts for each mode; `make soak` (NULLTICKETS_SOAK=1) runs 50 with full.
"""

from __future__ import annotations

import bisect
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import apsw
import pytest

from nulltickets.storage.sqlite import walsync
from nulltickets.storage.sqlite.connection import TEST_POWERCUT_VFS
from nulltickets.storage.sqlite.database import Database
from tests.conftest import wait_for
from tests.fixtures.reference import CRASHED, FINISHED, WAITING, build_reference_db
from tests.reliability.helpers import (
    Agent,
    Journals,
    assert_storage_healthy,
    open_db,
    percentile,
    rows,
    start_agent,
    storage_health,
)
from tests.reliability.invariants import acknowledged_lost, check_tasks
from tests.reliability.report import REPO, Recorder, scale
from tests.reliability.test_server_crash import DEFINITION, acked, create_tasks, progressed
from tests.server import Server

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(sys.platform == "win32", reason="servers are killed with SIGKILL"),
]

AGENTS = 3
TASKS = scale(600, 10000)  # enough that the agents never run out, even on a fast machine
LEASE_TTL_MS = 3000
KINDS = ("sigkill", "torn", "checkpoint")


@dataclass
class Cut:
    kind: str
    at_ms: int  # wall clock of the cut (the agents' journals use the same clock)
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class Outcome:
    cuts: list[Cut]
    journals: Journals
    checked: int
    lost: list[tuple[str, dict[str, Any]]]
    problems: list[str]
    summary: dict[str, int]
    health: dict[str, Any]
    seed: int

    def lost_per_cut(self) -> list[int]:
        """How many lost acknowledgements each cut took (the first cut after each one)."""
        times = [c.at_ms for c in self.cuts]
        per = [0] * len(self.cuts)
        for _, entry in self.lost:
            i = bisect.bisect_left(times, int(entry["t"]))
            per[min(i, len(per) - 1)] += 1
        return per

    def ms_before_cut(self) -> list[int]:
        """For each lost acknowledgement: how long before the cut that lost it it was given."""
        times = [c.at_ms for c in self.cuts]
        out = []
        for _, entry in self.lost:
            i = min(bisect.bisect_left(times, int(entry["t"])), len(times) - 1)
            out.append(times[i] - int(entry["t"]))
        return out


class PowerCutServer:
    """A server on the power-cut VFS; each start can arm a different cut."""

    def __init__(self, workdir: Path, durability: str, base: str, seed: int) -> None:
        self.workdir = workdir
        self.base = base
        self.seed = seed
        self.report = workdir / "cuts.jsonl"
        self.cut_file = workdir / "cut-now"
        self.server = Server(workdir / "power.db", args=["--durability", durability])
        self.starts = 0
        self.reports_at_start = 0

    def start(self, arm: str = "") -> None:
        self.starts += 1
        spec = f"{self.base},seed={self.seed + self.starts},report={self.report}"
        if arm:
            spec += "," + arm
        self.server.env = {TEST_POWERCUT_VFS: spec}
        self.reports_at_start = len(self.reports())
        self.server.start(timeout=60)

    def reports(self) -> list[dict[str, Any]]:
        if not self.report.exists():
            return []
        return [json.loads(line) for line in self.report.read_text().splitlines() if line]

    def cut(self, kind: str, rng: random.Random) -> Cut:
        """Cut the running server `kind`'s way, and leave it down."""
        before = len(self.reports()) if kind == "torn" else self.reports_at_start
        if kind == "sigkill":
            at = time.time_ns() // 1_000_000
            kill(self.server)
            return Cut(kind, at)
        if kind == "torn":
            self.cut_file.touch()
        # "checkpoint" was armed at start: it comes (or came) with a background checkpoint.
        wait_for(f"the VFS to cut ({kind})", lambda: len(self.reports()) > before, timeout=90)
        kill(self.server)  # the supervisor, and anything it started again
        self.cut_file.unlink(missing_ok=True)
        report = self.reports()[-1]
        return Cut(kind, int(report["t_ms"]), report)

    def arm_for(self, kind: str, rng: random.Random) -> str:
        if kind == "checkpoint":
            return f"cut-at=db:{rng.randint(1, 40)}:nulltickets-checkpointer"
        if kind == "torn":
            return f"cut-file={self.cut_file}"
        return ""


def kill(server: Server) -> None:
    """SIGKILL the server's processes and wait until each one is really gone.

    A process SIGKILLed is not dead yet when kill() returns: until it has exited it holds its
    locks on the WAL index, and a connection opened meanwhile trusts that index (which
    describes writes the cut took away) instead of rebuilding it from the files."""
    if server.proc is None:
        return
    pids = server.kill()
    wait_for("the killed server processes to exit", lambda: not any(map(alive, pids)), 30)


def holders(db: Path) -> list[str]:
    """The processes that have the database, its WAL or its WAL index open: none should."""
    names = {str(db), f"{db}-wal", f"{db}-shm"}
    found = []
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            if not {os.readlink(fd) for fd in fd_dir.iterdir()} & names:
                continue
            cmd = (fd_dir.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
        except OSError:  # gone meanwhile, or not ours to read
            continue
        found.append(f"{fd_dir.parent.name} {cmd}")
    return found


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False)
    children = [int(p) for p in out.stdout.split()]
    return [d for c in children for d in (c, *descendants(c))]


def alive(pid: int) -> bool:
    """Still running (a zombie has exited and let go of its files)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return not any(
        line.split()[1:2] == ["Z"] for line in status.splitlines() if line.startswith("State:")
    )


def run_power_cuts(
    workdir: Path, durability: str, cycles: int, *, base: str = "tear,reorder", rng_seed: int
) -> Outcome:
    """Agents at work, `cycles` cuts and restarts, a last cut; then what the files hold."""
    rng = random.Random(rng_seed)
    power = PowerCutServer(workdir, durability, base, rng_seed)
    agents: list[Agent] = []
    stop = workdir / "stop"
    cuts: list[Cut] = []
    try:
        # The tasks are made and the server stopped cleanly: what the cuts can lose is the
        # agents' work, not the set-up.
        power.start()
        admin = power.server.client()
        r = admin.post("/pipelines", {"name": "power", "definition": DEFINITION})
        assert r.status == 201, r.body
        task_ids = create_tasks(admin, r.json["id"], TASKS)
        admin.close()
        assert power.server.stop() in (0, -15, 143)

        kinds = [KINDS[i % len(KINDS)] for i in range(cycles)]
        power.start(power.arm_for(kinds[0], rng))
        for i in range(AGENTS):
            agents.append(
                start_agent(
                    workdir,
                    f"agent-{i}",
                    power.server.port,
                    "--roles",
                    "coder,reviewer" if i % 2 else "reviewer,coder",
                    "--events",
                    "2",
                    "--fail-ratio",
                    "0.1",
                    "--store",
                    "--think-ms",
                    "5",
                    "--lease-ttl-ms",
                    str(LEASE_TTL_MS),
                    "--stop-file",
                    str(stop),
                    "--retry-s",
                    "120",
                    "--seed",
                    str(rng_seed + i),
                    *(["--claim-key"] if i % 2 else []),
                )
            )
        wait_for("the agents to get going", lambda: acked(agents) >= 20, timeout=60)
        for cycle, kind in enumerate(kinds):
            before = acked(agents)
            time.sleep(rng.uniform(0.3, 1.5))
            wait_for(f"work between cuts (cycle {cycle})", progressed(agents, before), 60)
            cuts.append(power.cut(kind, rng))
            time.sleep(rng.uniform(0.0, 0.3))
            following = kinds[cycle + 1] if cycle + 1 < len(kinds) else "sigkill"
            power.start(power.arm_for(following, rng))
            assert all(a.proc.poll() is None for a in agents), [a.output() for a in agents]

        before = acked(agents)
        wait_for("work after the last restart", lambda: acked(agents) > before + 10, 60)
        stop.touch()
        for agent in agents:
            assert agent.wait(150) == 0, agent.output()
        cuts.append(power.cut("sigkill", rng))  # the files are checked as the last cut left them
        # A power cut wipes shared memory: the WAL index goes with it, and the check rebuilds it
        # from what the WAL file really holds, as the next start would. Left on disk, it can
        # describe frames the cut took away, and SQLite then answers "disk I/O error".
        Path(f"{power.server.db}-shm").unlink(missing_ok=True)

        journals = Journals.of(agents)
        try:
            health = storage_health(power.server.db)
        except apsw.Error as exc:  # the file unreadable: a finding, to be replayed by its seed
            exc.add_note(f"power cuts with seed {rng_seed} ({durability}, {base})")
            exc.add_note(f"processes with the files open: {holders(power.server.db)}")
            raise
        problems, summary = check_tasks(power.server.db, DEFINITION)
        lost, checked = acknowledged_lost(power.server.db, journals)
        with open_db(power.server.db) as conn:
            stored = {r[0] for r in rows(conn, "SELECT id FROM tasks")}
        problems += [f"task {t} of the set-up lost" for t in task_ids if t not in stored]
        problems += [f"server error: {e}" for e in journals.ops("server_error")[:5]]
        return Outcome(cuts, journals, checked, lost, problems, summary, health, rng_seed)
    finally:
        stop.touch()
        for agent in agents:
            agent.kill()
        kill(power.server)


def describe_cuts(cuts: list[Cut]) -> str:
    kinds = {k: sum(1 for c in cuts if c.kind == k) for k in (*KINDS,)}
    torn = sum(
        1
        for c in cuts
        for f in c.detail.get("files", {}).values()
        if f.get("torn_to") is not None and f.get("pending")
    )
    return (
        f"cuts: {kinds['sigkill']} by SIGKILL, {kinds['torn']} torn and reordered, "
        f"{kinds['checkpoint']} inside a background checkpoint ({torn} files torn)"
    )


def assert_healthy(outcome: Outcome) -> None:
    assert outcome.health["integrity"] == ["ok"], outcome.health
    assert outcome.health["foreign_keys"] == [], outcome.health
    assert outcome.health["fts"] == "ok", outcome.health
    assert outcome.problems == [], outcome.problems[:20]


@pytest.mark.slow
@pytest.mark.timeout(scale(300, 2400))
def test_power_cuts_with_durability_full_lose_nothing_acknowledged(
    tmp_path: Path, record: Recorder
) -> None:
    cycles = scale(3, 50)
    row = record(
        "power cut",
        f"power cuts under {AGENTS} agent processes (claim -> events -> transition/fail -> "
        "store) on a VFS that forgets unsynced writes, tears and reorders them; restart on the "
        "same files (durability full)",
        0,
        "power cuts",
    )
    seed = random.randrange(2**32)
    outcome = run_power_cuts(tmp_path, "full", cycles, rng_seed=seed)
    row.tried = len(outcome.cuts)
    assert_healthy(outcome)
    assert outcome.lost == [], [m for m, _ in outcome.lost[:20]]
    checkpoint_cuts = [c for c in outcome.cuts if c.kind == "checkpoint"]
    assert all("db file" in c.detail["reason"] for c in checkpoint_cuts)
    row.detail = (
        f"{describe_cuts(outcome.cuts)}; {outcome.checked} acknowledged answers checked, 0 lost; "
        f"{outcome.summary['tasks']} tasks in one stage each, none completed twice; "
        f"integrity_check ok, foreign_key_check clean, FTS5 integrity-check ok; 0 corrupt "
        f"files; seed {seed}"
    )
    row.extra.update(acknowledged=outcome.checked, lost=0, seed=seed, cuts=len(outcome.cuts))


@pytest.mark.slow
@pytest.mark.timeout(scale(300, 1500))
def test_power_cuts_with_durability_normal_lose_recent_writes_but_never_corrupt(
    tmp_path: Path, record: Recorder
) -> None:
    cycles = scale(3, 20)
    row = record(
        "power cut",
        "the same power cuts with durability normal: how many acknowledged writes a cut loses, "
        "and how long before the cut they were acknowledged; the file is never corrupt",
        0,
        "power cuts",
    )
    seed = random.randrange(2**32)
    outcome = run_power_cuts(tmp_path, "normal", cycles, rng_seed=seed)
    row.tried = len(outcome.cuts)
    assert_healthy(outcome)
    per_cut = outcome.lost_per_cut()
    ms = outcome.ms_before_cut()
    losing = [n for n in per_cut if n]
    row.detail = (
        f"{describe_cuts(outcome.cuts)}; 0 corrupt files, invariants hold; "
        f"{len(outcome.lost)} of {outcome.checked} acknowledged answers lost; "
        f"{len(losing)} of {len(per_cut)} cuts lost any, at most {max(per_cut)} per cut"
        + (
            f" (median {percentile(losing, 50):.0f} among those); the lost ones were "
            f"acknowledged at most {max(ms)} ms before the cut (median {percentile(ms, 50):.0f}"
            " ms)"
            if ms
            else ""
        )
        + f"; seed {seed}"
    )
    row.extra.update(
        acknowledged=outcome.checked,
        lost=len(outcome.lost),
        lost_per_cut=per_cut,
        max_ms_before_cut=max(ms) if ms else 0,
        median_ms_before_cut=percentile(ms, 50) if ms else 0,
        seed=seed,
        cuts=len(outcome.cuts),
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_disk_that_ignores_xsync_is_caught_losing_acknowledged_writes(
    tmp_path: Path, record: Recorder
) -> None:
    """The fault check: the harness must see the losses a lying disk causes, or its zero for
    durability full proves nothing."""
    row = record(
        "power cut",
        "fault check: the same suite on a VFS that ignores xSync (a disk that lies), "
        "durability full, must report lost acknowledged writes",
        0,
        "power cuts",
    )
    seed = random.randrange(2**32)
    outcome = run_power_cuts(tmp_path, "full", 2, base="lying", rng_seed=seed)
    row.tried = len(outcome.cuts)
    assert outcome.health["integrity"] == ["ok"], outcome.health
    assert len(outcome.lost) > 0, "a lying disk lost nothing: the harness cannot see losses"
    row.detail = (
        f"{len(outcome.lost)} of {outcome.checked} acknowledged answers reported lost "
        f"after {len(outcome.cuts)} cuts; seed {seed}"
    )
    row.extra.update(lost=len(outcome.lost), acknowledged=outcome.checked, seed=seed)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_durability_full_without_its_wal_sync_is_caught_losing_acknowledged_writes(
    tmp_path: Path, record: Recorder
) -> None:
    """The same fault check for the writer's own barrier: with durability full the commits
    themselves do not sync (synchronous=NORMAL), the writer's WAL sync thread does. A VFS that
    ignores xSync from that thread only (every sync SQLite makes itself still works) must make
    the suite report losses, or the zero above would not prove that the barrier is what keeps
    the answered writes."""
    row = record(
        "power cut",
        "fault check: durability full with its WAL sync made a no-op (a VFS that ignores xSync "
        "from the writer's sync thread only) must report lost acknowledged writes",
        0,
        "power cuts",
    )
    seed = random.randrange(2**32)
    base = f"tear,reorder,lying-thread={walsync.THREAD_NAME}"
    outcome = run_power_cuts(tmp_path, "full", 2, base=base, rng_seed=seed)
    row.tried = len(outcome.cuts)
    assert_healthy(outcome)  # what SQLite syncs itself keeps the file sound
    assert len(outcome.lost) > 0, "without its WAL sync, full lost nothing: it proves nothing"
    row.detail = (
        f"{len(outcome.lost)} of {outcome.checked} acknowledged answers reported lost "
        f"after {len(outcome.cuts)} cuts; seed {seed}"
    )
    row.extra.update(lost=len(outcome.lost), acknowledged=outcome.checked, seed=seed)


# --- the WAL's copy-back by the writer, and migrations ------------------------------------------

WRITER = """
import sys
from nulltickets.domain.commands import CreatePipeline, CreateTask
from nulltickets.domain.clock import wall_ms as now_ms
from nulltickets.service import Tracker
from nulltickets.storage.sqlite.database import Database
from tests.reliability.test_server_crash import DEFINITION
import msgspec

db = Database(sys.argv[1], durability="full")
db.open()
# Past one frame the writer copies the WAL back itself after every transaction (database.py):
# what the server does only past 16,000 frames, here at once.
db.writer.checkpointer.limit = 1
tracker = Tracker()
definition = msgspec.Raw(msgspec.json.encode(DEFINITION))
pid = db.write_sync(lambda b: tracker.create_pipeline(b, CreatePipeline("p", definition), now_ms()))
for i in range(100000):
    def job(b, i=i):
        return [tracker.add_task(b, CreateTask(pid, f"t{i}-{n}", "x" * 200), now_ms())
                for n in range(5)]
    for task_id in db.write_sync(job):
        print(task_id, flush=True)
"""


# Which write to the database file each cut comes at, by phase, so that every run cuts in each:
# the file's creation (switching it to WAL mode, before any migration commits), the copy-back of
# the migrations (about the first 90 writes: no task committed yet), then the tasks' copy-backs.
COPY_BACK_PHASES = ((1, 2), (3, 90), (100, 300))


@pytest.mark.slow
@pytest.mark.timeout(scale(180, 900))
def test_a_cut_during_the_writers_own_copy_back_loses_nothing_committed(
    tmp_path: Path, record: Recorder
) -> None:
    cuts = scale(4, 20)
    row = record(
        "power cut",
        "power cut while the writer copies the WAL back itself (past its WAL limit), torn and "
        "reordered, durability full",
        0,
        "power cuts",
    )
    rng = random.Random()
    acknowledged = 0
    for n in range(cuts):
        path = tmp_path / f"copyback{n}.db"
        report = tmp_path / f"copyback{n}.jsonl"
        at = rng.randint(*COPY_BACK_PHASES[min(n, len(COPY_BACK_PHASES) - 1)])
        spec = f"tear,reorder,seed={rng.randrange(2**32)},report={report},cut-at=db:{at}:MainThread"
        out = subprocess.run(
            [sys.executable, "-c", WRITER, str(path)],
            env={**os.environ, TEST_POWERCUT_VFS: spec},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert out.returncode == -9, out.stderr[-2000:]
        [cut] = [json.loads(line) for line in report.read_text().splitlines()]
        assert cut["reason"] == f"write {at} to the db file", cut
        ids = out.stdout.split()
        acknowledged += len(ids)
        # The file as the cut left it: never corrupt. A cut at its first writes (switching a new
        # file to WAL mode, before the first migration commits) leaves it empty, which is why
        # the full check, the full-text index's included, comes after a restart.
        before = storage_health(path)
        assert (before["integrity"], before["foreign_keys"]) == (["ok"], []), before
        restart(path)
        assert_storage_healthy(path)
        with open_db(path) as conn:
            stored = {r[0] for r in rows(conn, "SELECT id FROM tasks")}
        missing = [t for t in ids if t not in stored]
        assert missing == [], f"{len(missing)} of {len(ids)} committed tasks lost (cut {n})"
        row.tried = n + 1
    assert acknowledged > 0  # the later cuts came after tasks were committed
    row.detail = f"{acknowledged} committed tasks checked, 0 lost, 0 corrupt files"


def restart(path: Path) -> None:
    """Open the file as a server's start does (WAL recovery, then any migration a cut
    interrupted), and close it."""
    db = Database(str(path), durability="full")
    db.open()
    db.close()


LEGACY_TABLES = ("pipelines", "tasks", "runs", "leases", "events", "store")


def legacy_database(path: Path, rows_in_store: int) -> dict[str, int]:
    """The original's file with a store big enough that migrating it takes many writes;
    returns how many rows each of its tables holds."""
    build_reference_db(path)
    with open_db(path) as conn:
        with conn:
            for i in range(rows_in_store):
                value = json.dumps({"n": i, "text": f"legacy note number {i} " + "word " * 20})
                conn.execute(
                    "INSERT INTO store VALUES ('legacy', ?, ?, 1700000000000, 1700000000000)",
                    (f"k{i}", value),
                )
        return table_counts(conn)


def table_counts(conn: Any) -> dict[str, int]:
    return {t: int(rows(conn, f"SELECT count(*) FROM {t}")[0][0]) for t in LEGACY_TABLES}


@pytest.mark.slow
@pytest.mark.timeout(scale(300, 900))
def test_a_cut_during_the_migration_at_start_loses_nothing_that_was_there(
    tmp_path: Path, record: Recorder
) -> None:
    """Cut the server while it migrates an old file (at a write to the WAL, or to the database
    file while the migration's end is checkpointed), at later and later writes until one start
    gets through; each time the next start must migrate cleanly and lose nothing."""
    store_rows = 2000
    row = record(
        "power cut",
        "power cut while the server migrates a file the original made (torn and reordered, "
        "at every stage of the migration), then a clean restart (durability full)",
        0,
        "power cuts",
    )
    tried = 0
    for kind in ("wal", "db"):
        at = 1
        while True:
            workdir = tmp_path / f"{kind}{at}"
            workdir.mkdir()
            db = workdir / "legacy.db"
            counts = legacy_database(db, store_rows)
            server = Server(db, args=["--durability", "full"])
            report = workdir / "cut.jsonl"
            spec = f"tear,reorder,seed={at},report={report},cut-at={kind}:{at}"
            server.env = {TEST_POWERCUT_VFS: spec}
            try:
                server.start(timeout=60)
                started = True
            except RuntimeError:
                started = False
            finally:
                kill(server)
            if started:
                assert not report.exists(), server.output()
                break
            assert report.exists(), server.output()  # the cut ended it, nothing else
            tried += 1
            check_migrated_after_restart(server, store_rows, counts)
            at = at * 3
    row.tried = tried
    row.detail = (
        f"{tried} cuts (at WAL and database-file writes 1, 3, 9, ... until a start got "
        f"through); every restart migrated cleanly, the original's tasks and {store_rows} "
        "store entries all there, integrity checks ok"
    )


def check_migrated_after_restart(server: Server, store_rows: int, counts: dict[str, int]) -> None:
    server.env = {TEST_POWERCUT_VFS: "on"}
    server.start(timeout=60)
    try:
        client = server.client()
        for task_id in (FINISHED, WAITING, CRASHED):
            r = client.get(f"/tasks/{task_id}")
            assert r.status == 200, (task_id, r.status, r.body)
        for key in ("k0", f"k{store_rows // 2}", f"k{store_rows - 1}"):
            r = client.get(f"/store/legacy/{key}")
            assert r.status == 200, (key, r.status, r.body)
        client.close()
    finally:
        assert server.stop() in (0, -15, 143)
    assert_storage_healthy(server.db)
    with open_db(server.db) as conn:
        assert table_counts(conn) == counts
        version = conn.pragma("user_version")
    from nulltickets.storage.sqlite.connection import migrations

    assert version == len(migrations())
