"""The README and the docs site run as written: their shell and Python blocks, in order, against
a real server.

The README runs alone; the site's pages run one after another in the order of its navigation
(mkdocs.yml), in one session, so a page continues the shell session of the pages before it as
the site tells its reader (Getting started sets `$B` and `$pipeline`). The shell blocks run in
one bash session (variables carry from block to block), with `set -euo pipefail`, in an empty
directory, with this checkout's `nulltickets` first on PATH. The test fills in only what a
reader's machine decides: the server's address (the pages say 127.0.0.1:7700; the test's server
listens on a free port). A block the test cannot run (it builds the project, downloads a
release, or starts a server that runs until stopped) says so in a comment right above it:
`<!-- readme-test: skip REASON -->`.

The reference pages the site renders from the code (the API, the error codes) are checked here
too, and the settings page against the config module's table of settings.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
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
from types import ModuleType

import pytest

from tests.server import Server

pytestmark = [pytest.mark.process, pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MKDOCS = ROOT / "mkdocs.yml"
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


def site_pages() -> list[Path]:
    """The docs site's pages in the order of its navigation."""
    nav = re.findall(r"^\s*- (?:[^:\n]+: )?(\S+\.md)\s*$", MKDOCS.read_text(), re.MULTILINE)
    return [DOCS / name for name in nav]


def test_the_site_navigation_holds_every_page() -> None:
    pages = site_pages()
    assert len(pages) >= 20
    missing = [p for p in pages if not p.is_file()]
    assert missing == []
    outside = sorted(
        str(p.relative_to(DOCS))
        for p in DOCS.rglob("*.md")
        if p not in pages and "hooks" not in p.parts
    )
    assert outside == [], "pages not in mkdocs.yml's nav"


@pytest.mark.parametrize("path", [README, *site_pages()], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_block_is_run_or_says_why_not(path: Path) -> None:
    for block in blocks(path.read_text()):
        if block.language in RUNNABLE or block.skip is not None:
            continue
        # Text blocks without a language (diagrams, tables, logs) are not code.
        where = f"{path.relative_to(ROOT)}:{block.line}"
        assert block.language == "", f"{where}: a ```{block.language} block"


def test_the_examples_are_meant_to_be_run() -> None:
    def runnable(path: Path) -> int:
        found = blocks(path.read_text())
        return sum(1 for b in found if b.language in RUNNABLE and b.skip is None)

    assert runnable(README) >= 4, "the README's examples are meant to be run"
    assert sum(runnable(p) for p in site_pages()) >= 12, "the site's examples too"


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


def run_as_written(tmp_path: Path, pages: list[Path]) -> int:
    """Every runnable block of the pages, in order, against one fresh server; the number run."""
    for tool in ("bash", "curl", "jq"):
        assert shutil.which(tool), f"the examples use {tool}: install it"
    server = Server(tmp_path / "examples.db").start()
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
        for page in pages:
            for block in blocks(page.read_text()):
                if block.language not in RUNNABLE or block.skip is not None:
                    continue
                text = block.text.replace("127.0.0.1:7700", address)
                where = f"{page.relative_to(ROOT)}:{block.line}"
                if block.language == "sh":
                    output = shell.run(text)
                else:
                    script = work / f"example_{ran}.py"
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
    return ran


def test_the_readme_runs_as_written(tmp_path: Path) -> None:
    assert run_as_written(tmp_path, [README]) >= 4


def test_the_docs_run_as_written(tmp_path: Path) -> None:
    assert run_as_written(tmp_path, site_pages()) >= 12


def _reference_hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_reference", DOCS / "hooks" / "reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_api_page_renders_every_operation_and_schema() -> None:
    from nulltickets.http import openapi

    document = openapi.document()
    page = _reference_hook().render_api(document)
    doc = json.loads(document)
    for path, operations in doc["paths"].items():
        for method in operations:
            assert f"### `{method.upper()} {path}`" in page
    for name in doc["components"]["schemas"]:
        assert f"{{#schema-{name.lower()}}}" in page
    assert (DOCS / "reference" / "api.md").read_text().count(_reference_hook().API_MARKER) == 1


def test_the_error_page_lists_every_error_class_with_its_status() -> None:
    from nulltickets import errors
    from nulltickets.http.errors import STATUS

    page = _reference_hook().render_errors()
    classes = [c for c in vars(errors).values() if isinstance(c, type)]
    for cls in classes:
        if issubclass(cls, errors.TrackerError):
            status = next(STATUS[k] for k in cls.__mro__ if k in STATUS)
            assert f"| {status} | `{cls.code}` | `{cls.__name__}` |" in page
    marker = _reference_hook().ERRORS_MARKER
    assert (DOCS / "reference" / "errors.md").read_text().count(marker) == 1


def test_every_setting_is_documented() -> None:
    from nulltickets import config

    rows = [
        r for r in (DOCS / "reference" / "settings.md").read_text().splitlines() if r[:1] == "|"
    ]
    for _setting, flag, key, env in config.SETTINGS:
        row = next((r for r in rows if r.startswith(f"| `{flag}")), None)
        assert row is not None, f"{flag} has no row in docs/reference/settings.md"
        assert f"`{key}`" in row and f"`{env}`" in row, row
