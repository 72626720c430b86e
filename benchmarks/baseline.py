"""The cycle rows of an earlier revision beside the working tree's, measured in the same run
(`python -m benchmarks --baseline REV`): SQLite's, and with the postgres section PostgreSQL's.

The revision is checked out with `git worktree add` into a temporary folder (removed again
afterwards, with its worktree entry) and served by this same Python and its installed
dependencies, with PYTHONPATH pointing at the checkout's `src`. Both sides run the same core
implementation: the checkout's compiled core is built in place when the working tree's is
compiled (Cython and a C compiler, as `make install` uses); when that build fails, or the
working tree's core is interpreted, both sides run the interpreted core
(NULLTICKETS_PURE_PYTHON=1). Which one ran is part of the result."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from types import TracebackType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SUFFIXES = tuple(importlib.machinery.EXTENSION_SUFFIXES)

PROBE = (
    "import nulltickets, nulltickets._cext, nulltickets.core as c; "
    "print(c.IMPLEMENTATION); print(nulltickets.__file__); print(nulltickets._cext.__file__)"
)


class BaselineError(Exception):
    """The revision could not be checked out or does not import from its checkout."""


def _git(repo: Path, *args: str) -> str:
    try:
        done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    except OSError as exc:  # no git at all
        raise BaselineError(f"git {args[0]}: {exc}") from None
    if done.returncode != 0:
        detail = (done.stderr.strip() or done.stdout.strip()).splitlines()
        raise BaselineError(f"git {args[0]}: {detail[-1] if detail else done.returncode}")
    return done.stdout.strip()


class BaselineTree:
    """A checkout of `rev` in a temporary folder, with the environment that serves it.

    `core` is "compiled" when the checkout's compiled core was built (only tried when
    `build_core`), else "python"; `env(core)` is the environment for a server of the checkout
    running that core."""

    def __init__(self, rev: str, *, repo: Path = ROOT, build_core: bool = True) -> None:
        self.rev, self.repo, self.build_core = rev, repo, build_core
        self.folder = Path(tempfile.mkdtemp(prefix="nulltickets-baseline-"))
        self.path = self.folder / "tree"
        self.commit = ""
        self.core = "python"
        self.build_note = ""

    def __enter__(self) -> BaselineTree:
        try:
            self.commit = _git(self.repo, "rev-parse", "--verify", f"{self.rev}^{{commit}}")
            _git(self.repo, "worktree", "add", "--detach", str(self.path), self.commit)
            self._link_cext()
            if self.build_core:
                self._build()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()

    def remove(self) -> None:
        """Remove the checkout and its worktree entry (also after a failed start)."""
        if self.path.exists():
            subprocess.run(
                ["git", "-C", str(self.repo), "worktree", "remove", "--force", str(self.path)],
                capture_output=True,
            )
        shutil.rmtree(self.folder, ignore_errors=True)
        subprocess.run(["git", "-C", str(self.repo), "worktree", "prune"], capture_output=True)

    def _link_cext(self) -> None:
        # An install maps the package nulltickets._cext to the tree's cext/ folder; on
        # PYTHONPATH the checkout needs it inside src/nulltickets, else Python would find the
        # working tree's (through its editable install) instead.
        cext, link = self.path / "cext", self.path / "src" / "nulltickets" / "_cext"
        if cext.is_dir() and not link.exists():
            link.symlink_to(Path("..", "..", "cext"), target_is_directory=True)

    def _build(self) -> None:
        """The checkout's compiled core. When its cext/ is this tree's, byte for byte, this
        tree's build of it is the checkout's too and is copied; else the checkout is built as
        a wheel, the way `make install` builds (pip, in an isolated build environment; the
        venv gets nothing new), and the core is taken from it. A failure leaves the
        interpreted core and says why in `build_note`."""
        ours = compiled_core_file()
        same = subprocess.run(
            ["git", "-C", str(self.repo), "diff", "--quiet", self.commit, "--", "cext"],
            capture_output=True,
        )
        if ours is not None and same.returncode == 0:
            shutil.copy2(ours, self.path / "cext" / ours.name)
            self.build_note = "cext/ unchanged since the revision: this tree's compiled core"
        else:
            self.build_note = self._build_wheel()
        built, _ = self.probe("compiled")
        if built == "compiled":
            self.core = "compiled"

    def _build_wheel(self) -> str:
        wheels = self.folder / "wheels"
        done = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(wheels),
             str(self.path)],
            capture_output=True,
            text=True,
        )  # fmt: skip
        if done.returncode != 0:
            lines = (done.stderr.strip() or done.stdout.strip()).splitlines()
            return f"the wheel did not build: {lines[-1] if lines else done.returncode}"
        for wheel in wheels.glob("*.whl"):
            with zipfile.ZipFile(wheel) as archive:
                for name in archive.namelist():
                    if name.startswith("nulltickets/_cext/core.") and name.endswith(SUFFIXES):
                        target = self.path / "cext" / Path(name).name
                        target.write_bytes(archive.read(name))
                        return "built from the revision's cext/ (a wheel of the checkout)"
        return "the revision's wheel has no compiled core"

    def env(self, core: str) -> dict[str, str]:
        src = str(self.path / "src")
        extra = os.environ.get("PYTHONPATH")
        env = {"PYTHONPATH": src + (os.pathsep + extra if extra else "")}
        env.update(core_env(core))
        return env

    def probe(self, core: str) -> tuple[str, str]:
        """Which core a server of the checkout would run, and from where it imports."""
        done = subprocess.run(
            [sys.executable, "-c", PROBE],
            env={**os.environ, **self.env(core)},
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines()
            raise BaselineError(f"{self.rev} does not import: {lines[-1] if lines else '?'}")
        implementation, package, cext = done.stdout.split()
        for where in (package, cext):
            if not Path(where).resolve().is_relative_to(self.path.resolve()):
                raise BaselineError(f"{self.rev} imports from outside its checkout: {where}")
        return implementation, package


def compiled_core_file() -> Path | None:
    """This tree's compiled core (the extension module), when it was built."""
    spec = importlib.util.find_spec("nulltickets._cext.core")
    origin = Path(spec.origin) if spec is not None and spec.origin else None
    return origin if origin is not None and origin.name.endswith(SUFFIXES) else None


def core_env(core: str) -> dict[str, str]:
    """The environment that makes a server run `core` ("compiled" or "python")."""
    return {"NULLTICKETS_PURE_PYTHON": "1" if core == "python" else "0"}


def common_core(current: str, baseline: str) -> str:
    """The core both sides can run: compiled only when both have it."""
    return "compiled" if current == baseline == "compiled" else "python"


def compare(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """One comparison row from the median runs of the two sides."""
    rate0, rate1 = before["cycles_per_s"], after["cycles_per_s"]
    return {
        "agents": after["agents"],
        "durability": after["durability"],
        "before_cycles_per_s": rate0,
        "after_cycles_per_s": rate1,
        "ratio": round(rate1 / rate0, 3) if rate0 else None,
        "before_rounds_cycles_per_s": before["rounds_cycles_per_s"],
        "after_rounds_cycles_per_s": after["rounds_cycles_per_s"],
        "exactly_once": before["completed_exactly_once"] and after["completed_exactly_once"],
        "before_server_cpu_ms": before.get("server_cpu_ms_per_cycle"),
        "after_server_cpu_ms": after.get("server_cpu_ms_per_cycle"),
    }


def render(b: dict[str, Any]) -> list[str]:
    """The comparison as Markdown lines."""
    if "error" in b:
        return [f"No comparison with {b['rev']}: {b['error']}"]
    lines = [
        f"Cycle rows of {b['rev']} ({b['commit'][:9]}) beside this tree, interleaved "
        f"runs ({b['core']} core on both sides):",
        "",
        "| engine | agents | durability | before cycles/s | after cycles/s | after/before | "
        "server CPU ms/cycle before / after | runs before | runs after |",
        "|---|---:|---|---:|---:|---:|---|---|---|",
    ]
    for row in b["rows"]:
        ratio = f"{row['ratio']:.2f}" if row["ratio"] is not None else "n/a"
        cpu = " / ".join(
            "-" if v is None else f"{v:.2f}"
            for v in (row.get("before_server_cpu_ms"), row.get("after_server_cpu_ms"))
        )
        lines.append(
            f"| {row.get('engine', 'sqlite')} | {row['agents']} | {row['durability']} | "
            f"{row['before_cycles_per_s']:.0f} | {row['after_cycles_per_s']:.0f} | {ratio} | "
            f"{cpu} | "
            + ", ".join(f"{v:.0f}" for v in row["before_rounds_cycles_per_s"])
            + " | "
            + ", ".join(f"{v:.0f}" for v in row["after_rounds_cycles_per_s"])
            + " |"
        )
    if b.get("note"):
        lines.append(f"\n{b['note']}")
    if b.get("postgres_error"):
        lines.append(f"\nNo PostgreSQL rows: {b['postgres_error']}")
    return lines
