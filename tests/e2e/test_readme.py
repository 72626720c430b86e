"""The README runs as written: its shell and Python blocks, in order, against a real server.

The shell blocks run in one bash session (variables carry from block to block), with `set -euo
pipefail`, in an empty directory, with this checkout's `nulltickets` first on PATH. The test
fills in only what a reader's machine decides: the server's address (the README says
127.0.0.1:7700; the test's server listens on a free port). A block the test cannot run (it
builds the project, downloads a release, or starts a server that runs until stopped) says so in
a comment right above it: `<!-- readme-test: skip REASON -->`.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.server import Server

pytestmark = [pytest.mark.process, pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RUNNABLE = ("sh", "python")
SKIP = re.compile(r"<!--\s*readme-test:\s*skip\s+(?P<why>.+?)\s*-->\s*$")
BLOCK_TIMEOUT_S = 90


@dataclass
class Block:
    line: int
    language: str
    text: str
    skip: str | None


def blocks(text: str) -> list[Block]:
    found: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if fence is None:
            i += 1
            continue
        start, language = i, fence.group(1)
        i += 1
        body: list[str] = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        above = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        skip = SKIP.match(above.strip())
        found.append(Block(start + 1, language, "\n".join(body) + "\n", skip and skip["why"]))
        i += 1
    return found


def test_every_block_is_run_or_says_why_not() -> None:
    every = blocks(README.read_text())
    assert every, "no code blocks found"
    for block in every:
        if block.language in RUNNABLE or block.skip is not None:
            continue
        # Text blocks without a language (diagrams, tables) are not code.
        assert block.language == "", f"README.md:{block.line}: a ```{block.language} block"
    run = [b for b in every if b.language in RUNNABLE and b.skip is None]
    assert len(run) >= 5, "the README's examples are meant to be run"


class Shell:
    """One bash session fed block by block; each block's output and status come back."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            ["bash", "--noprofile", "--norc"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=env,
            start_new_session=True,  # so that close() can stop whatever a block left running
        )
        self.run("set -euo pipefail")

    def run(self, script: str, timeout: float = BLOCK_TIMEOUT_S) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        marker = f"__block_done_{time.monotonic_ns()}__"
        self.proc.stdin.write(f"{script}\necho {marker}\n".encode())
        self.proc.stdin.flush()
        out = b""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while marker.encode() not in out:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"block still running after {timeout}s:\n{out.decode()}")
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                code = self.proc.wait()
                raise AssertionError(f"block failed (status {code}):\n{out.decode()}")
            out += chunk
        return out.decode().replace(marker, "").rstrip("\n")

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def test_the_readme_runs_as_written(tmp_path: Path) -> None:
    for tool in ("bash", "curl", "jq"):
        assert shutil.which(tool), f"the README's examples use {tool}: install it"
    server = Server(tmp_path / "readme.db").start()
    work = tmp_path / "work"
    work.mkdir()
    bin_dir = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "NULLTICKETS_HOME": str(tmp_path / "home"),
        "PYTHON": sys.executable,
    }
    for name in list(env):
        if name.startswith("NULLTICKETS_") and name not in ("NULLTICKETS_HOME",):
            env.pop(name)  # the examples must not lean on the test's own settings
    address = f"127.0.0.1:{server.port}"
    shell = Shell(work, env)
    ran = 0
    try:
        for block in blocks(README.read_text()):
            if block.language not in RUNNABLE or block.skip is not None:
                continue
            text = block.text.replace("127.0.0.1:7700", address)
            where = f"README.md:{block.line}"
            if block.language == "sh":
                output = shell.run(text)
            else:
                script = work / f"readme_{block.line}.py"
                script.write_text(text)
                done = subprocess.run(
                    [sys.executable, str(script)],
                    cwd=work,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=BLOCK_TIMEOUT_S,
                )
                output = done.stdout + done.stderr
                assert done.returncode == 0, f"{where} failed:\n{output}"
            assert "Traceback" not in output, f"{where}:\n{output}"
            assert '"error"' not in output, f"{where} got an error answer:\n{output}"
            ran += 1
    finally:
        shell.close()
        server.stop()
    assert ran >= 5
