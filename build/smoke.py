"""Smoke-test a built executable before it is uploaded: it runs, serves and claims.

    python build/smoke.py dist/nulltickets-linux-x86_64.bin [--expect-core compiled|python]

`--version`, `--export-manifest`, then `serve` on a free port and a fresh database: the first
200 from /health (its time is printed), one pipeline, one task, one claim that must return that
task, the MCP server's tools listed on POST /mcp and by `mcp` on stdio (the SDK is in the
binary), and a clean stop on SIGTERM. On Linux it also checks that the server's worker has uvloop
loaded (granian picks its loop by importing it by name, so a binary built without it would
silently run on asyncio). Standard library only: release jobs run it on a bare Python.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def source_version() -> str:
    text = (ROOT / "src" / "nulltickets" / "__init__.py").read_text(encoding="utf-8")
    m = re.search(r'^__version__ = "([^"]+)"', text, re.M)
    assert m, "no __version__ in src/nulltickets/__init__.py"
    return m.group(1)


def vendored_sqlite() -> tuple[str, set[str]]:
    """vendor/sqlite's version and the options /health must report (build/sqlite-options.txt,
    as apsw.compile_options spells them, among those the server reports)."""
    header = (ROOT / "vendor" / "sqlite" / "sqlite3.h").read_text(encoding="utf-8")
    m = re.search(r'^#define SQLITE_VERSION\s+"([^"]+)"', header, re.M)
    assert m, "no SQLITE_VERSION in vendor/sqlite/sqlite3.h"
    options = set()
    text = (ROOT / "build" / "sqlite-options.txt").read_text(encoding="utf-8")
    for line in text.splitlines():
        fields = line.split("#", 1)[0].split()
        if fields:
            options.add(fields[0].removeprefix("SQLITE_"))
    reported = ("ENABLE_", "OMIT_", "DQS=", "THREADSAFE=", "DEFAULT_MEMSTATUS=", "LIKE_DOESNT")
    return m.group(1), {o for o in options if o.startswith(reported)}


def wait_healthy(proc: subprocess.Popen[bytes], port: int, timeout: float) -> float:
    """Seconds from now until the first `200` from /health; polls every 5 ms."""
    started = time.perf_counter()
    deadline = started + timeout
    while time.perf_counter() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"smoke: server exited with {proc.returncode} before it was healthy")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return time.perf_counter() - started
        except OSError:
            pass
        time.sleep(0.005)
    raise SystemExit(f"smoke: /health not 200 within {timeout}s")


def request(port: int, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        payload = r.read()
        return r.status, json.loads(payload) if payload else None
    finally:
        conn.close()


MCP_HELLO: list[dict[str, Any]] = [
    {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": {"name": "smoke", "version": "1"},
        },
    },
    {"jsonrpc": "2.0", "method": "notifications/initialized"},
    {"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
]


def mcp_over_http(port: int) -> list[str]:
    """The tools POST /mcp lists (JSON-RPC, one request per POST)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    names: list[str] = []
    try:
        for message in MCP_HELLO:
            headers = {
                "Content-Type": "application/json",
                "Accept": "application/json, text/event-stream",
            }
            conn.request("POST", "/mcp", body=json.dumps(message).encode(), headers=headers)
            r = conn.getresponse()
            payload = r.read()
            if message.get("id") == 2:
                check(r.status == 200, f"POST /mcp tools/list answers 200 ({r.status})")
                names = [t["name"] for t in json.loads(payload)["result"]["tools"]]
    finally:
        conn.close()
    return names


def mcp_over_stdio(binary: Path, port: int, timeout: float) -> list[str]:
    """The tools `nulltickets mcp` lists on stdio (newline-delimited JSON-RPC)."""
    lines = "".join(json.dumps(m) + "\n" for m in MCP_HELLO)
    proc = subprocess.Popen(
        [str(binary), "mcp", "--base", f"http://127.0.0.1:{port}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(lines)
    proc.stdin.flush()
    deadline = time.monotonic() + timeout
    names: list[str] = []
    try:
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            answer = json.loads(line)
            if answer.get("id") == 2:
                names = [t["name"] for t in answer["result"]["tools"]]
                break
    finally:
        proc.stdin.close()  # a clean end: the process exits by itself
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            check(False, "`mcp` exits once its stdin closes")
    if not names:
        print(proc.stderr.read() if proc.stderr else "", file=sys.stderr)
    return names


def descendants(pid: int) -> list[int]:
    """Linux: every process below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def loaded_uvloop(pid: int) -> bool:
    """Linux: True if every leaf process of the server's tree (granian's workers, which run the
    event loop) has uvloop's extension mapped."""
    tree = [pid, *descendants(pid)]
    leaves = [p for p in tree if not descendants(p)]
    try:
        return bool(leaves) and all("uvloop" in Path(f"/proc/{p}/maps").read_text() for p in leaves)
    except OSError:
        return False


def stop(proc: subprocess.Popen[bytes]) -> int:
    if sys.platform == "win32":
        proc.terminate()
    else:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise SystemExit("smoke: server did not stop within 30 s of SIGTERM") from None


def check(ok: bool, what: str) -> None:
    if not ok:
        raise SystemExit(f"smoke: FAILED: {what}")
    print(f"smoke: ok: {what}", flush=True)


def smoke(
    binary: Path, expect_core: str | None, timeout: float, uvloop_check: bool = True
) -> dict[str, Any]:
    version = source_version()
    # The first run unpacks the onefile payload: slow under emulation, so the same patience.
    slow = max(60.0, timeout)
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=slow)
    line = out.stdout.strip()
    m = re.fullmatch(r"nulltickets v(\S+) \(core: (compiled|python)\)", line)
    check(out.returncode == 0 and m is not None, f"--version prints {line!r}")
    assert m is not None
    check(m.group(1) == version, f"version {m.group(1)} is the source's {version}")
    if expect_core:
        check(m.group(2) == expect_core, f"core is {expect_core}")

    pure_env = {**os.environ, "NULLTICKETS_PURE_PYTHON": "1"}
    out = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, timeout=slow, env=pure_env
    )
    check(
        out.returncode == 0 and out.stdout.strip().endswith("(core: python)"),
        f"NULLTICKETS_PURE_PYTHON=1 selects the interpreted core ({out.stdout.strip()!r}"
        f"{out.stderr.strip()[-300:]})",
    )

    out = subprocess.run(
        [str(binary), "--export-manifest"], capture_output=True, text=True, timeout=slow
    )
    manifest = json.loads(out.stdout)
    check(
        out.returncode == 0
        and manifest["name"] == "nulltickets"
        and manifest["version"] == version,
        "--export-manifest prints nullhub's manifest",
    )

    with tempfile.TemporaryDirectory(prefix="nulltickets-smoke-") as tmp:
        port = free_port()
        env = {**os.environ, "NULLTICKETS_HOME": str(Path(tmp) / "home")}
        env.pop("NULLTICKETS_PORT", None)
        cmd = [str(binary), "serve", "--port", str(port), "--db", str(Path(tmp) / "smoke.db")]
        log_path = Path(tmp) / "server.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            try:
                healthy_s = wait_healthy(proc, port, timeout)
            except SystemExit:
                print(log_path.read_text(errors="replace"), file=sys.stderr)
                raise
            check(True, f"first 200 from /health after {healthy_s * 1000:.0f} ms")
            status, health = request(port, "GET", "/health")
            check(
                status == 200 and health["status"] == "ok" and health["version"] == version,
                f"/health says ok, version {version}, core {health.get('core')}",
            )
            sqlite_version, sqlite_options = vendored_sqlite()
            check(
                health.get("sqlite_version") == sqlite_version,
                f"/health reports SQLite {health.get('sqlite_version')}, vendor/sqlite's",
            )
            missing = sqlite_options - set(health.get("sqlite_options", []))
            check(not missing, f"/health reports build/sqlite-options.txt (missing: {missing})")
            log_text = log_path.read_text(errors="replace")
            check(
                f"SQLite {sqlite_version} (" in log_text,
                "the start line names the SQLite version and options",
            )
            definition = {
                "initial": "todo",
                "states": {"todo": {"agent_role": "smoke"}, "done": {"terminal": True}},
                "transitions": [{"from": "todo", "to": "done", "trigger": "complete"}],
            }
            status, pipe = request(
                port, "POST", "/pipelines", {"name": "smoke", "definition": definition}
            )
            check(status == 201, f"pipeline created ({status} {pipe})")
            status, task = request(
                port,
                "POST",
                "/tasks",
                {"pipeline_id": pipe["id"], "title": "smoke test", "description": "smoke"},
            )
            check(status == 201, f"task created ({status} {task})")
            status, claim = request(
                port, "POST", "/leases/claim", {"agent_id": "smoke-1", "agent_role": "smoke"}
            )
            check(
                status == 200 and claim["task"]["id"] == task["id"] and claim["lease_token"],
                "claim returns the task with a lease",
            )
            listed = mcp_over_http(port)
            check("claim_task" in listed, f"POST /mcp lists the tools ({len(listed)})")
            listed = mcp_over_stdio(binary, port, slow)
            check("claim_task" in listed, f"`mcp` on stdio lists the tools ({len(listed)})")
            uvloop = None
            if sys.platform.startswith("linux") and uvloop_check:
                uvloop = loaded_uvloop(proc.pid)
                check(uvloop, "the server's worker runs uvloop (its extension is mapped there)")
        finally:
            code = stop(proc)
        if sys.platform == "win32":
            # Windows has no SIGTERM: terminate() ends the process outright.
            print(f"smoke: stopped (status {code})", flush=True)
        else:
            check(code == 0, f"clean exit on SIGTERM (status {code})")
    return {
        "binary": str(binary),
        "version_line": line,
        "healthy_ms": round(healthy_s * 1000, 1),
        "core": health.get("core"),
        "uvloop": uvloop,
        "sqlite_version": health.get("sqlite_version"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("binary", type=Path)
    p.add_argument("--expect-core", choices=("compiled", "python"), default=None)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for /health")
    p.add_argument(
        "--no-uvloop-check",
        action="store_true",
        help="skip the /proc check for uvloop (under QEMU user emulation /proc shows the host)",
    )
    args = p.parse_args(argv)
    result = smoke(args.binary.resolve(), args.expect_core, args.timeout, not args.no_uvloop_check)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
