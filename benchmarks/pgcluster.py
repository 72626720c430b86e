"""A throwaway PostgreSQL cluster, started and stopped by its caller: the benchmarks' postgres
section and the tests' session server (tests/pgserver.py) are both this one.

It runs from the distribution's packages (scripts/postgres.sh install; `make test` and
`make bench` do that) in a temporary data directory, listening on a free port of 127.0.0.1
and on a unix socket in that directory, with fsync on, and is stopped (fast shutdown) and
removed at the end. If its caller ends without stopping it (SIGTERM, SIGKILL, a crash), a
guard process of its own (benchmarks/pgguard.py) does that instead. initdb refuses to run as
root, so as root the cluster belongs to the `postgres` user the package creates. When
PostgreSQL cannot be found or started, PostgresUnavailable says why in one line and the caller
reports that line (the tests fail with it, the benchmark prints it in its rows).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.pgguard import alive, postmaster_pid

START_TIMEOUT_S = 60.0


class PostgresUnavailable(Exception):
    pass


def find_bindir() -> Path:
    """The folder of pg_ctl and initdb: $NULLTICKETS_PG_BINDIR, else the newest
    /usr/lib/postgresql/*/bin (Debian, Ubuntu), else $PGBIN, a Homebrew postgresql@N or
    wherever pg_ctl is on PATH."""
    forced = os.environ.get("NULLTICKETS_PG_BINDIR")
    candidates = [Path(forced)] if forced else []

    def newest_first(pattern: str) -> list[Path]:
        def version(path: Path) -> int:
            digits = "".join(c for c in path.parent.name if c.isdigit())
            return int(digits) if digits else 0

        return sorted((Path(p) for p in glob.glob(pattern)), key=version, reverse=True)

    candidates += newest_first("/usr/lib/postgresql/*/bin")
    if os.environ.get("PGBIN"):
        candidates.append(Path(os.environ["PGBIN"]))
    candidates += newest_first("/opt/homebrew/opt/postgresql@*/bin")
    candidates += newest_first("/usr/local/opt/postgresql@*/bin")
    on_path = shutil.which("pg_ctl")
    if on_path:
        candidates.append(Path(on_path).resolve().parent)
    exe = ".exe" if os.name == "nt" else ""
    for folder in candidates:
        if (folder / f"pg_ctl{exe}").exists() and (folder / f"initdb{exe}").exists():
            return folder
    raise PostgresUnavailable(
        "no PostgreSQL server found (no pg_ctl/initdb in /usr/lib/postgresql/*/bin or on PATH): "
        "run `bash scripts/postgres.sh install` (make test does)"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresServer:
    """A throwaway PostgreSQL cluster; `dsn(name)` addresses one of its databases."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="nulltickets-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = 0
        self._as: dict[str, Any] = {}
        self.guard: subprocess.Popen[bytes] | None = None
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            import pwd

            try:
                owner = pwd.getpwnam("postgres")
            except KeyError:
                raise PostgresUnavailable(
                    "running as root, and there is no `postgres` user to own the test cluster"
                ) from None
            os.chown(self.root, owner.pw_uid, owner.pw_gid)
            self._as = {"user": owner.pw_uid, "group": owner.pw_gid, "extra_groups": []}

    def _run(self, *args: str, timeout: float = START_TIMEOUT_S) -> None:
        try:
            done = subprocess.run(
                args,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
                cwd=self.root,
                **self._as,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise PostgresUnavailable(f"{Path(args[0]).name} failed: {exc}") from None
        if done.returncode != 0:
            detail = (done.stderr.strip() or done.stdout.strip()).splitlines()
            tail = detail[-1] if detail else f"exit status {done.returncode}"
            raise PostgresUnavailable(f"{Path(args[0]).name} failed: {tail}")

    def start(self) -> PostgresServer:
        self._start_guard()
        self._run(
            str(self.bindir / "initdb"),
            "-D", str(self.data),
            "-U", "postgres",
            "-A", "trust",
            "-E", "UTF8",
            "--no-locale",
            "--no-sync",  # the fresh cluster's own files; the server itself runs with fsync on
        )  # fmt: skip
        for attempt in range(3):  # a free port can be taken between choosing and binding it
            self.port = free_port()
            try:
                self._pg_ctl_start()
                break
            except PostgresUnavailable:
                if attempt == 2:
                    raise PostgresUnavailable(
                        f"PostgreSQL did not start: {self.last_log_line()}"
                    ) from None
        self.wait_until_ready()
        return self

    def _start_guard(self) -> None:
        """benchmarks/pgguard.py: it ends the cluster and removes its directory if this process
        ends without calling stop() (killed, or a crash), as nothing else would."""
        if os.name == "nt" or self.guard is not None:
            return
        self.guard = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).with_name("pgguard.py")),
                str(os.getpid()),
                str(self.data),
                str(self.root),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a signal to this process's group leaves it its work
        )

    def _end_guard(self) -> None:
        if self.guard is not None:
            self.guard.kill()
            self.guard.wait()
            self.guard = None

    def last_log_line(self) -> str:
        try:
            lines = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "no server log"
        return lines[-1] if lines else "empty server log"

    def wait_until_ready(self) -> None:
        import psycopg

        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                psycopg.connect(self.dsn("postgres"), connect_timeout=5).close()
                return
            except psycopg.OperationalError as exc:
                if time.monotonic() > deadline:
                    raise PostgresUnavailable(
                        f"PostgreSQL does not accept connections: {exc}"
                    ) from None
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the postmaster and every backend of the cluster: a crash, not a shutdown
        (the next start recovers from the WAL)."""
        import signal

        postmaster = postmaster_pid(self.data)
        if postmaster is None:
            return
        # Stopped first, the postmaster forks no backend between the listing of its children
        # and the kill: one forked then would outlive it, attached to the shared memory, and
        # the next start would refuse ("pre-existing shared memory block is still in use").
        stop = getattr(signal, "SIGSTOP", None)
        if stop is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(postmaster, stop)
        found = subprocess.run(
            ["pgrep", "-P", str(postmaster)], capture_output=True, text=True, check=False
        ).stdout.split()
        every = [postmaster, *map(int, found)]
        for pid in every:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + START_TIMEOUT_S
        for pid in every:  # each gone (reaped), the postmaster first
            while time.monotonic() < deadline and alive(pid):
                time.sleep(0.05)

    def cpu_s(self) -> float:
        """The CPU time (user and system, seconds) of the whole cluster so far: the postmaster,
        its live processes (backends, checkpointer, WAL writer, autovacuum) and, through the
        postmaster's children's times, every backend that has exited. 0.0 where /proc is not
        there. A difference of two readings is the cluster's CPU in between, a backend that
        exits meanwhile included."""
        postmaster = postmaster_pid(self.data)
        if postmaster is None:
            return 0.0
        found = subprocess.run(
            ["pgrep", "-P", str(postmaster)], capture_output=True, text=True, check=False
        ).stdout.split()
        return sum(_proc_cpu_s(pid) for pid in [postmaster, *map(int, found)])

    def restart(self) -> None:
        """Start the cluster again on its data directory and port (after `kill`)."""
        self._pg_ctl_start()
        self.wait_until_ready()

    def _pg_ctl_start(self) -> None:
        options = " ".join(
            [
                "-c listen_addresses=127.0.0.1",
                f"-c port={self.port}",
                # Windows: TCP only.
                f"-c unix_socket_directories={self.root if os.name != 'nt' else ''}",
                "-c fsync=on",
                "-c synchronous_commit=on",
                "-c max_connections=100",
            ]
        )
        self._run(
            str(self.bindir / "pg_ctl"),
            "-D", str(self.data),
            "-l", str(self.log),
            "-o", options,
            "-w", "-t", str(int(START_TIMEOUT_S)),
            "start",
        )  # fmt: skip

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)
        self._end_guard()

    def dsn(self, dbname: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def admin(self) -> Any:
        """An autocommit connection to the maintenance database."""
        import psycopg

        return psycopg.connect(self.dsn("postgres"), autocommit=True)

    def create_database(self) -> str:
        """A new, empty database; returns its name."""
        name = f"t_{uuid.uuid4().hex[:16]}"
        with self.admin() as conn:
            conn.execute(f'CREATE DATABASE "{name}" TEMPLATE template0')
        return name

    @contextlib.contextmanager
    def database(self) -> Iterator[str]:
        """A new, empty database for one measured run, dropped after it. A database left
        behind is one more that autovacuum visits during the later runs, on the same cores and
        counted in their PostgreSQL CPU: the tables of a finished run, full of the versions its
        claims and transitions left, are vacuumed and analyzed while another run is measured,
        and a benchmark of a hundred runs leaves a hundred databases for the launcher to visit
        every minute."""
        name = self.create_database()
        try:
            yield name
        except BaseException:
            with contextlib.suppress(Exception):  # the run's own error is the one to hear
                self.drop_database(name)
            raise
        self.drop_database(name)

    def drop_database(self, name: str) -> None:
        """Drop `name`, ending any connection still open to it."""
        with self.admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _proc_cpu_s(pid: int) -> float:
    """A process's CPU time and that of its children it has waited for (utime, stime, cutime
    and cstime of /proc/PID/stat), in seconds; 0.0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def start_postgres() -> PostgresServer:
    server = PostgresServer(find_bindir())
    try:
        return server.start()
    except BaseException:
        server.stop()
        raise
