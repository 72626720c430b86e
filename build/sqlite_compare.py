"""The benchmark side by side: apsw's PyPI wheel (its bundled SQLite) against apsw built from
its sdist with vendor/sqlite and build/sqlite-options.txt (what the release binaries carry).

    python build/sqlite_compare.py run [--quick] [--rounds N] [--dir DIR]
    python build/sqlite_compare.py compare WHEEL.json VENDORED.json

`run` makes two virtual environments in DIR (default dist/sqlite-compare) from this
interpreter, `pip install -e .` in both and build/build_apsw.py in the second, runs
`python -m benchmarks` in each (wheel first, then vendored) into DIR/wheel.json and
DIR/vendored.json, and prints the comparison. It takes as long as two `make bench` runs and
needs the machine to itself. `compare` prints the table for two existing results files (for
example two `make bench` runs, one after `make binary` replaced .venv's apsw).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# (label, path into the results JSON, True when higher is better)
Metric = tuple[str, list[str | int], bool]


def metrics(results: dict[str, Any]) -> list[Metric]:
    found: list[Metric] = []
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


def venv(path: Path, vendored: bool) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    py = path / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    subprocess.run([str(py), "-m", "pip", "install", "--quiet", "-e", str(ROOT)], check=True)
    if vendored:
        subprocess.run([str(py), str(ROOT / "build" / "build_apsw.py")], check=True, cwd=ROOT)
    return py


def run(folder: Path, quick: bool, rounds: int | None) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, vendored in (("wheel", False), ("vendored", True)):
        py = venv(folder / f"venv-{name}", vendored)
        cmd = [str(py), "-m", "benchmarks", "--out", str(folder / f"{name}.json")]
        cmd += ["--quick"] if quick else []
        cmd += ["--rounds", str(rounds)] if rounds else []
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT)
        out[name] = json.loads((folder / f"{name}.json").read_text())
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
