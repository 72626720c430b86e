"""Turn the reliability suites' own record (the JSON `make soak` writes) into RELIABILITY.md.

    python scripts/reliability_report.py reliability-results.json RELIABILITY.md
    python scripts/reliability_report.py --merge new.json reliability-results.json RELIABILITY.md

With --merge, the rows of the suites that new.json holds replace those suites' rows in
reliability-results.json (the other suites' rows stay as they are), the merged record is
written back there, and RELIABILITY.md is made from it: one suite can be run again alone
without running every other one for as long.

Rows of one check (a parametrized test, or one test run per case) are added up into one line:
the times tried summed, the worst outcome kept, distinct details joined.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

SUITES = {
    "server crash": "1. Server crash under load",
    "agent crash": "2. Agent crashes",
    "abuse": "3. Abuse",
    "fuzz": "4. Fuzzing from the contract",
    "security": "5. Security",
    "faults": "6. Faults",
    "power cut": "7. Power cuts",
}
# Worst first: one failing case makes the whole line fail.
OUTCOMES = ["failed", "xpass", "not run", "xfail", "skipped", "passed"]
SHOWN = {
    "passed": "pass",
    "failed": "**FAIL**",
    "xfail": "**known bug**",
    "xpass": "**XPASS** (bug fixed? remove the xfail mark)",
    "skipped": "skipped",
    "not run": "**not run**",
}


def merge(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        key = (row["suite"], row["check"])
        line = merged.get(key)
        if line is None:
            line = merged[key] = {
                "suite": row["suite"],
                "check": row["check"],
                "unit": row["unit"],
                "tried": 0,
                "outcome": "passed",
                "details": [],
                "reasons": [],
                "tests": set(),
                "seconds": 0.0,
            }
        line["tried"] += row["tried"]
        line["seconds"] += row["seconds"]
        line["tests"].add(row["test"])
        if OUTCOMES.index(row["outcome"]) < OUTCOMES.index(line["outcome"]):
            line["outcome"] = row["outcome"]
        for field, value in (("details", row["detail"]), ("reasons", row["reason"])):
            if value and value not in line[field]:
                line[field].append(value)
    return list(merged.values())


def result(line: dict[str, Any]) -> str:
    outcome = line["outcome"]
    text = str(SHOWN.get(outcome, outcome))
    details = "; ".join(line["details"])
    if outcome in ("failed", "xfail", "xpass", "skipped") and line["reasons"]:
        text += ": " + "; ".join(line["reasons"])
        if details:
            text += f". Seen: {details}"
    elif details:
        text += f": {details}"
    return text.replace("|", "\\|").replace("\n", " ")


def run_line(env: dict[str, Any], alone: bool = False) -> str:
    if alone:
        mode = "long version (NULLTICKETS_SOAK=1)" if env["soak"] else "short version"
    else:
        mode = "`make soak` (NULLTICKETS_SOAK=1)" if env["soak"] else "`make test` (short versions)"
    commit = env["commit"] + (" with local changes" if env.get("dirty") else "")
    return (
        f"{mode}, {env['generated_at']}, nulltickets {env['nulltickets']} at {commit}, "
        f"Python {env['python']}, SQLite {env['sqlite']}, {env['platform']} with "
        f"{env['cpus']} cores"
    )


def merge_runs(new: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
    """`old` with the rows of every suite `new` has replaced by `new`'s rows."""
    suites = sorted({row["suite"] for row in new["rows"]})
    kept = [row for row in old["rows"] if row["suite"] not in suites]
    runs = [r for r in old.get("runs", []) if not set(r["suites"]) <= set(suites)]
    runs.append({"suites": suites, "environment": new["environment"]})
    return {"environment": old["environment"], "runs": runs, "rows": kept + new["rows"]}


def render(doc: dict[str, Any]) -> str:
    env = doc["environment"]
    lines = merge(doc["rows"])
    out = [
        "# Reliability",
        "",
        "What the reliability suites (`tests/reliability/`) tried against the real server, how "
        "many times, and what happened. This file is generated from the suites' own record by "
        "`make soak`, which runs the long versions and then "
        "`scripts/reliability_report.py`; `make test` runs the short versions of the same tests "
        "(5 kill/restart cycles instead of 25, 3 power cuts per durability mode instead of 50 "
        "and 20, seconds of abuse instead of minutes, a bounded number of fuzz examples).",
        "",
        f"Run: {run_line(env)}."
        + "".join(
            f" Suite{'s' if len(run['suites']) > 1 else ''} "
            f"{' and '.join(SUITES.get(s, s).split('. ', 1)[0] for s in run['suites'])} "
            f"ran later on {'their' if len(run['suites']) > 1 else 'its'} own: "
            f"{run_line(run['environment'], alone=True)}."
            for run in doc.get("runs", [])
        ),
        "",
        "A **known bug** is a test that asserts the correct behaviour and is marked "
        "`xfail(strict=True)` until the server is fixed; its line says what happens instead.",
        "",
        "| suite | what was tried | times | result |",
        "|---|---|---:|---|",
    ]
    order = list(SUITES)
    lines.sort(key=lambda ln: order.index(ln["suite"]) if ln["suite"] in order else 99)
    for line in lines:
        suite = SUITES.get(line["suite"], line["suite"])
        what = line["check"].replace("|", "\\|")
        times = f"{line['tried']:,} {line['unit']}"
        out.append(f"| {suite} | {what} | {times} | {result(line)} |")
    counts: dict[str, int] = {}
    for line in lines:
        counts[line["outcome"]] = counts.get(line["outcome"], 0) + 1
    out += [
        "",
        "Totals: "
        + ", ".join(f"{n} {SHOWN.get(k, k).strip('*')}" for k, n in sorted(counts.items()))
        + f" ({len(doc['rows'])} test results).",
    ]
    out += durability_section(doc["rows"])
    bugs = [line for line in lines if line["outcome"] == "xfail"]
    if bugs:
        out += ["", "## Known server bugs", ""]
        for line in bugs:
            tests = ", ".join(sorted(t.split("::", 1)[1] for t in line["tests"]))
            out.append(f"- {'; '.join(line['reasons'])} (`{tests}`)")
    out += [
        "",
        "## Reproduce",
        "",
        "```sh",
        "make test                                   # the short versions, with everything else",
        "make soak                                   # the long versions; rewrites this file",
        ".venv/bin/python -m pytest tests/reliability -q   # the short versions alone",
        "```",
        "",
    ]
    return "\n".join(out)


def _power_cut_row(rows: list[dict[str, Any]], test: str) -> dict[str, Any] | None:
    found = [r for r in rows if r["suite"] == "power cut" and r["test"].endswith("::" + test)]
    return found[-1] if found else None


def durability_section(rows: list[dict[str, Any]]) -> list[str]:
    """What each --durability mode survives, in the power-cut suite's own figures."""
    full = _power_cut_row(rows, "test_power_cuts_with_durability_full_lose_nothing_acknowledged")
    normal = _power_cut_row(
        rows, "test_power_cuts_with_durability_normal_lose_recent_writes_but_never_corrupt"
    )
    lying = _power_cut_row(
        rows, "test_a_disk_that_ignores_xsync_is_caught_losing_acknowledged_writes"
    )
    if full is None or normal is None:
        return []
    out = [
        "",
        "## What each `--durability` mode survives",
        "",
        "- **A crash of the server process** (SIGKILL; the kernel still holds what was "
        "written): both modes lose nothing acknowledged (suite 1 with `full`; "
        "`tests/integration/test_powercut_vfs.py` checks both at the SQLite level).",
    ]
    if full["outcome"] == "passed":
        x = full["extra"]
        out.append(
            f"- **A power cut, `--durability full`** (suite 7, on a VFS that forgets every "
            f"write not yet synced, tearing and reordering some): {x['cuts']} cuts, "
            f"{x['acknowledged']:,} acknowledged answers checked, **0 lost, 0 corrupt files**."
        )
    else:
        out.append(f"- **A power cut, `--durability full`**: {SHOWN.get(full['outcome'])}.")
    if normal["outcome"] == "passed":
        x = normal["extra"]
        per_cut = x["lost_per_cut"]
        ms = (
            f", each acknowledged at most {x['max_ms_before_cut']:,} ms before its cut "
            f"(median {x['median_ms_before_cut']:,} ms)"
            if x["lost"]
            else ""
        )
        out.append(
            f"- **A power cut, `--durability normal`**: {x['cuts']} cuts lost "
            f"{x['lost']:,} of {x['acknowledged']:,} acknowledged answers, "
            f"{sum(1 for n in per_cut if n)} of the cuts any, at most {max(per_cut)} per cut"
            f"{ms}. The WAL is synced only at checkpoints (every 1,000 pages written), so a cut "
            "loses the commits since the last one; **0 corrupt files**, every invariant held."
        )
    else:
        out.append(f"- **A power cut, `--durability normal`**: {SHOWN.get(normal['outcome'])}.")
    if lying is not None and lying["outcome"] == "passed":
        x = lying["extra"]
        out.append(
            f"- **A disk that acknowledges flushes it never makes** defeats both: the fault "
            f"check (the same suite, `full`, on a VFS that ignores xSync) saw {x['lost']:,} of "
            f"{x['acknowledged']:,} acknowledged answers lost, which is also what shows the "
            "suite can see a loss."
        )
    return out


def main(argv: list[str]) -> int:
    if len(argv) == 5 and argv[1] == "--merge":
        new = json.loads(Path(argv[2]).read_text(encoding="utf-8"))
        old = json.loads(Path(argv[3]).read_text(encoding="utf-8"))
        doc = merge_runs(new, old)
        Path(argv[3]).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        argv = [argv[0], argv[3], argv[4]]
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    doc = json.loads(Path(argv[1]).read_text(encoding="utf-8"))
    Path(argv[2]).write_text(render(doc), encoding="utf-8")
    print(f"{argv[2]}: {len(doc['rows'])} results", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
