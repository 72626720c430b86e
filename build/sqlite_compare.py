"""The benchmark side by side: apsw's PyPI wheel (its bundled SQLite) against apsw built from
its sdist with vendor/sqlite and build/sqlite-options.txt (what the release binaries carry).

    python build/sqlite_compare.py run [--quick] [--rounds N] [--dir DIR]
    python build/sqlite_compare.py compare WHEEL.json VENDORED.json

`run` makes two virtual environments in DIR (default dist/sqlite-compare) from this
interpreter and `pip install -e .` in both, then build/build_apsw.py in the second. It serves the
HTTP agent cycle of `make bench` from each in turn (1, 4, 16 and 64 agents with durability
normal, 16 with full; --quick: 1 and 4, and 4 with full), the two builds' runs alternating round
by round so that a busy machine's drift falls on both alike, writes DIR/wheel.json and
DIR/vendored.json (each row the median of its runs) and prints the comparison. Where valgrind
is installed it also counts the instructions of one in-process claim cycle on each side
(cachegrind), a figure that a busy machine does not move. Run it with the
Python of `make install` (.venv/bin/python), which has the benchmark's dependencies. `compare`
prints the table for two existing results files (for example two `make bench` runs, one after
`make binary` replaced .venv's apsw).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# (label, path into the results JSON, True when higher is better)
Metric = tuple[str, list[str | int], bool]


def metrics(results: dict[str, Any]) -> list[Metric]:
    found: list[Metric] = []
    if results.get("instructions_per_cycle"):
        found.append(("instructions per in-process cycle", ["instructions_per_cycle"], False))
    for i, c in enumerate(results.get("cycle", [])):
        found.append((f"cycles/s, {c['agents']} agents", ["cycle", i, "cycles_per_s"], True))
        found.append(
            (
                f"claim p99 ms, {c['agents']} agents",
                ["cycle", i, "latency_ms", "claim", "p99"],
                False,
            )
        )
    for d in results.get("durability", {}):
        found.append((f"cycles/s, durability {d}", ["durability", d, "cycles_per_s"], True))
    for k, v in results.get("backlog", {}).items():
        if isinstance(v, dict):
            found.append((f"backlog {k}: claim p50 ms", ["backlog", k, "claim_p50_ms"], False))
    for k, v in results.get("ops_queue", {}).items():
        if isinstance(v, dict):
            found.append((f"/ops/queue p50 ms, {k} tasks", ["ops_queue", k, "p50_ms"], False))
    return found


def lookup(doc: Any, path: list[str | int]) -> float | None:
    for key in path:
        try:
            doc = doc[key]
        except (KeyError, IndexError, TypeError):
            return None
    return float(doc) if isinstance(doc, int | float) else None


def compare(wheel: dict[str, Any], vendored: dict[str, Any]) -> str:
    """A Markdown table: each figure from both runs and the change (+ is better)."""
    ws, vs = wheel["machine"].get("sqlite"), vendored["machine"].get("sqlite")
    lines = [
        f"apsw wheel (SQLite {ws}) against vendor/sqlite (SQLite {vs})",
        "",
        "| figure | wheel | vendored | change |",
        "|---|---:|---:|---:|",
    ]
    for label, path, higher_better in metrics(wheel):
        a, b = lookup(wheel, path), lookup(vendored, path)
        if a is None or b is None:
            continue
        if a == 0:
            change = "n/a"
        else:
            gain = (b - a) / a if higher_better else (a - b) / a
            change = f"{gain * 100:+.1f}%"
        lines.append(f"| {label} | {a:.2f} | {b:.2f} | {change} |")
    lines.append("")
    lines.append("change: + means the vendored build is better (faster, or more cycles/s).")
    return "\n".join(lines)


SIDES = (("wheel", False), ("vendored", True))


def venv(path: Path, vendored: bool) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    py = path / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    # The versions `make install` and the releases use (constraints.txt): the wheel side is
    # then apsw 3.51.3.0's wheel with its bundled SQLite 3.51.3, the same version as ours.
    pip = [str(py), "-m", "pip", "install", "--quiet", "-c", str(ROOT / "constraints.txt")]
    subprocess.run([*pip, "-e", str(ROOT)], check=True)
    if vendored:
        subprocess.run([str(py), str(ROOT / "build" / "build_apsw.py")], check=True, cwd=ROOT)
    return py


def sqlite_version(py: Path) -> str:
    done = subprocess.run(
        [str(py), "-c", "import apsw; print(apsw.sqlite_lib_version())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return done.stdout.strip()


def rows_for(quick: bool) -> list[tuple[int, str]]:
    """(agents, durability) of every row: the cycle rows of `make bench` and `full` at 16."""
    if quick:
        return [(1, "normal"), (4, "normal"), (4, "full")]
    return [(1, "normal"), (4, "normal"), (16, "normal"), (64, "normal"), (16, "full")]


# The storage core's claim -> event -> transition cycle in-process (benchmarks/core.py), run
# for a number of cycles given as the argument.
CORE_CYCLES = (
    "import sys, tempfile, pathlib\n"
    f"sys.path.insert(0, {str(ROOT)!r})\n"
    "from benchmarks.core import _run\n"
    "_run(pathlib.Path(tempfile.mkdtemp()) / 'core.db', int(sys.argv[1]))\n"
)


def instructions(py: Path, cycles: int) -> int:
    """Instructions a process of `py` runs for `cycles` in-process cycles, counted by
    valgrind's cachegrind (no cache simulation): unlike time, the count does not depend on
    what else the machine is doing."""
    done = subprocess.run(
        [
            "valgrind",
            "--tool=cachegrind",
            "--cache-sim=no",
            "--cachegrind-out-file=/dev/null",
            str(py),
            "-c",
            CORE_CYCLES,
            str(cycles),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    found = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)  # "==1== I   refs:      1,890,724"
    if found:
        return int(found.group(1).replace(",", ""))
    raise RuntimeError(f"no instruction count from valgrind: {done.stderr[-500:]}")


def instructions_per_cycle(py: Path, quick: bool) -> float:
    """The instructions of one in-process cycle: the difference between a long and a short run
    divided by the cycles between them, which leaves out start-up and imports."""
    short, long = (100, 400) if quick else (200, 1_400)
    return (instructions(py, long) - instructions(py, short)) / (long - short)


def run(folder: Path, quick: bool, rounds: int | None) -> str:
    """Both builds on the same rows, their runs alternating (wheel, vendored, wheel, ...) so
    that a busy machine's drift falls on both alike; each row is the median of its runs."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.cycle import cycle, cycle_tasks, median_run

    folder.mkdir(parents=True, exist_ok=True)
    sides = {name: venv(folder / f"venv-{name}", vendored) for name, vendored in SIDES}
    rounds = max(1, rounds or (1 if quick else 3))
    out: dict[str, dict[str, Any]] = {
        name: {"machine": {"sqlite": sqlite_version(py)}, "cycle": [], "durability": {}}
        for name, py in sides.items()
    }
    for agents, durability in rows_for(quick):
        tasks = cycle_tasks(agents, quick)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
        for _ in range(rounds):
            for name, py in sides.items():
                cmd = [str(py), "-m", "nulltickets"]
                with tempfile.TemporaryDirectory(prefix="sqlite-compare-") as work:
                    runs[name].append(cycle(Path(work), agents, tasks, durability, cmd=cmd))
        for name, done in runs.items():
            row = median_run(done)
            if durability == "normal":
                out[name]["cycle"].append(row)
            else:
                out[name]["durability"][f"{agents}/{durability}"] = row
        w, v = (
            out[name]["durability"].get(f"{agents}/{durability}") or out[name]["cycle"][-1]
            for name in ("wheel", "vendored")
        )
        print(
            f"  {agents:>3} agents, {durability}: wheel {w['cycles_per_s']:>8.0f}, vendored "
            f"{v['cycles_per_s']:>8.0f} cycles/s (vendored/wheel "
            f"{v['cycles_per_s'] / w['cycles_per_s']:.2f})",
            flush=True,
        )
    if shutil.which("valgrind"):
        for name, py in sides.items():
            out[name]["instructions_per_cycle"] = round(instructions_per_cycle(py, quick))
    else:
        print("  valgrind is not installed: no instruction counts", flush=True)
    for name, results in out.items():
        results["rounds"] = rounds
        (folder / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    return compare(out["wheel"], out["vendored"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="benchmark both builds, then compare")
    r.add_argument("--quick", action="store_true")
    r.add_argument("--rounds", type=int, default=None)
    r.add_argument("--dir", type=Path, default=ROOT / "dist" / "sqlite-compare")
    c = sub.add_parser("compare", help="compare two results files")
    c.add_argument("wheel", type=Path)
    c.add_argument("vendored", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "run":
        print(run(args.dir, args.quick, args.rounds))
    else:
        print(compare(json.loads(args.wheel.read_text()), json.loads(args.vendored.read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
