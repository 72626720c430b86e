"""Measure the built executable: size, build time, start-up to first healthy /health, memory.

    python build/measure.py [BINARY] [--starts N] [--cycles N] [--out dist/binary-measure.json]

- size: the file's bytes.
- build time: from `<binary>.build.json`, written by build/binary.py (`make binary-measure`
  builds with empty Nuitka caches first, so it is a cold build).
- start-up: wall time from exec to the first `200` on /health, polled every 2 ms over fresh
  connections. The first start after install unpacks the onefile payload into the user's cache
  directory (measured with an empty `XDG_CACHE_HOME`); later starts reuse it (the median and the
  worst of `--starts` runs). `python -m nulltickets` from this interpreter is measured the same
  way for comparison.
- memory: peak RSS (VmHWM) of each process of the server (onefile bootstrap, granian's main
  process, its worker) after a small load: agents doing claim -> event -> transition cycles.

Linux only for memory (it reads /proc). Prints a Markdown table and writes the JSON.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "build"))

from smoke import descendants, free_port, loaded_uvloop  # noqa: E402


def start(
    cmd: Sequence[str], tmp: Path, env: dict[str, str]
) -> tuple[subprocess.Popen[bytes], float, int]:
    """Start the server; returns (process, seconds to first healthy /health, port)."""
    port = free_port()
    db = tmp / f"measure-{port}.db"
    full = [*cmd, "serve", "--port", str(port), "--db", str(db)]
    env = {**env, "NULLTICKETS_HOME": str(tmp / "home")}
    log = (tmp / f"server-{port}.log").open("wb")
    t0 = time.perf_counter()
    proc = subprocess.Popen(full, stdout=log, stderr=subprocess.STDOUT, env=env)
    log.close()
    while True:
        if proc.poll() is not None:
            raise SystemExit(
                f"measure: server exited with {proc.returncode}:\n"
                + (tmp / f"server-{port}.log").read_text(errors="replace")
            )
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return proc, time.perf_counter() - t0, port
        except OSError:
            pass
        if time.perf_counter() - t0 > 60:
            proc.kill()
            raise SystemExit("measure: not healthy after 60 s")
        time.sleep(0.002)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def startup_times(cmd: Sequence[str], n: int, env: dict[str, str]) -> list[float]:
    times = []
    for _ in range(n):
        with tempfile.TemporaryDirectory(prefix="nulltickets-measure-") as tmp:
            proc, seconds, _ = start(cmd, Path(tmp), env)
            stop(proc)
            times.append(seconds)
    return times


class Agent:
    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def call(self, method: str, path: str, body: Any = None, token: str | None = None) -> Any:
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        data = None if body is None else json.dumps(body).encode()
        self.conn.request(method, path, body=data, headers=headers)
        r = self.conn.getresponse()
        payload = r.read()
        if r.status >= 300:
            raise RuntimeError(f"{method} {path}: {r.status} {payload[:200]!r}")
        return json.loads(payload) if payload else None


def load(port: int, agents: int, cycles: int) -> dict[str, float]:
    """`cycles` tasks completed by `agents` threads, each claim -> event -> transition."""
    setup = Agent(port)
    definition = {
        "initial": "todo",
        "states": {"todo": {"agent_role": "measure"}, "done": {"terminal": True}},
        "transitions": [{"from": "todo", "to": "done", "trigger": "complete"}],
    }
    pipe = setup.call("POST", "/pipelines", {"name": "measure", "definition": definition})
    for i in range(cycles):
        setup.call(
            "POST", "/tasks", {"pipeline_id": pipe["id"], "title": f"task {i}", "description": ""}
        )
    done = [0] * agents

    def work(i: int) -> None:
        a = Agent(port)
        while True:
            a.conn.request(
                "POST",
                "/leases/claim",
                body=json.dumps({"agent_id": f"agent-{i}", "agent_role": "measure"}).encode(),
                headers={"Content-Type": "application/json"},
            )
            r = a.conn.getresponse()
            payload = r.read()
            if r.status == 204:
                return
            claim = json.loads(payload)
            run, token = claim["run"]["id"], claim["lease_token"]
            a.call("POST", f"/runs/{run}/events", {"kind": "progress", "data": {"i": i}}, token)
            a.call("POST", f"/runs/{run}/transition", {"trigger": "complete"}, token)
            done[i] += 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(agents)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    assert sum(done) == cycles, (sum(done), cycles)
    return {"cycles": cycles, "agents": agents, "seconds": round(seconds, 2)}


def peak_rss_mb(pid: int) -> dict[str, float]:
    """VmHWM in MB of each process of the server (Linux): the onefile parent, granian's main
    process (its child) and the worker (granian's child, a leaf). A process started without
    onefile has no parent entry."""
    tree = [pid, *descendants(pid)]
    leaves = {p for p in tree if not descendants(p)}
    out = {}
    for n, p in enumerate(tree):
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        kb = int(fields.get("VmHWM", "0 kB").split()[0])
        role = "worker" if p in leaves else ("onefile parent" if n == 0 else "granian main")
        out[f"{role} ({p})"] = round(kb / 1024, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("binary", type=Path, nargs="?", default=None)
    p.add_argument("--starts", type=int, default=5, help="cached starts to time")
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--cycles", type=int, default=2000)
    p.add_argument("--out", type=Path, default=ROOT / "dist" / "binary-measure.json")
    args = p.parse_args(argv)

    if args.binary is None:
        sys.path.insert(0, str(ROOT / "build"))
        from binary import asset_name, target

        args.binary = ROOT / "dist" / asset_name(*target())
    binary = args.binary.resolve()
    info_path = binary.with_name(binary.name + ".build.json")
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    env = dict(os.environ)
    env.pop("NULLTICKETS_PORT", None)

    result: dict[str, Any] = {
        "binary": binary.name,
        "size_bytes": binary.stat().st_size,
        "size_mb": round(binary.stat().st_size / 1e6, 1),
        "build_seconds": info.get("build_seconds"),
        "cold_build": info.get("cold_build"),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores",
        "python": info.get("python"),
    }

    # First start: nothing unpacked yet.
    cache = Path(tempfile.mkdtemp(prefix="nulltickets-xdg-cache-"))
    try:
        first = startup_times([str(binary)], 1, {**env, "XDG_CACHE_HOME": str(cache)})[0]
        unpacked = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
        again = startup_times([str(binary)], args.starts, {**env, "XDG_CACHE_HOME": str(cache)})
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    py = startup_times([sys.executable, "-m", "nulltickets"], args.starts, env)
    result["first_start_ms"] = round(first * 1000)
    result["unpacked_mb"] = round(unpacked / 1e6, 1)
    result["cached_start_ms_median"] = round(statistics.median(again) * 1000)
    result["cached_start_ms_max"] = round(max(again) * 1000)
    result["python_m_start_ms_median"] = round(statistics.median(py) * 1000)

    with tempfile.TemporaryDirectory(prefix="nulltickets-measure-") as tmp:
        proc, _, port = start([str(binary)], Path(tmp), env)
        try:
            idle = peak_rss_mb(proc.pid) if sys.platform.startswith("linux") else {}
            result["load"] = load(port, args.agents, args.cycles)
            if sys.platform.startswith("linux"):
                result["uvloop"] = loaded_uvloop(proc.pid)
                peaks = peak_rss_mb(proc.pid)
                result["idle_rss_mb"] = idle
                result["peak_rss_mb"] = peaks
                result["peak_rss_mb_total"] = round(sum(peaks.values()), 1)
                result["peak_rss_mb_worker"] = max(
                    v for k, v in peaks.items() if k.startswith("worker")
                )
        finally:
            stop(proc)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    rows = [
        ("size", f"{result['size_mb']} MB ({result['size_bytes']:,} bytes)"),
        (
            "build time",
            f"{result['build_seconds']} s ({'cold' if result['cold_build'] else 'warm'} caches)"
            if result["build_seconds"] is not None
            else "n/a",
        ),
        (
            "first start to healthy /health",
            f"{result['first_start_ms']} ms (unpacks {result['unpacked_mb']} MB)",
        ),
        (
            "later starts to healthy /health",
            f"{result['cached_start_ms_median']} ms median, {result['cached_start_ms_max']} ms max",
        ),
        ("`python -m nulltickets`, for comparison", f"{result['python_m_start_ms_median']} ms"),
    ]
    if "peak_rss_mb" in result:
        load_s = result["load"]
        rows.append(
            (
                f"peak RSS after {load_s['cycles']} agent cycles ({load_s['agents']} agents)",
                f"{result['peak_rss_mb_worker']} MB worker, "
                f"{result['peak_rss_mb_total']} MB all three processes",
            )
        )
        rows.append(("event loop", "uvloop" if result["uvloop"] else "asyncio"))
    print(f"| {result['binary']} ({result['machine']}) | |")
    print("|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
