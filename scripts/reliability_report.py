"""Turn the reliability suites' own record (the JSON `make soak` writes) into RELIABILITY.md.

    python scripts/reliability_report.py reliability-results.json RELIABILITY.md

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


def render(doc: dict[str, Any]) -> str:
    env = doc["environment"]
    lines = merge(doc["rows"])
    mode = "`make soak` (NULLTICKETS_SOAK=1)" if env["soak"] else "`make test` (short versions)"
    commit = env["commit"] + (" with local changes" if env.get("dirty") else "")
    out = [
        "# Reliability",
        "",
        "What the reliability suites (`tests/reliability/`) tried against the real server, how "
        "many times, and what happened. This file is generated from the suites' own record by "
        "`make soak`, which runs the long versions and then "
        "`scripts/reliability_report.py`; `make test` runs the short versions of the same tests "
        "(5 kill/restart cycles instead of 25, seconds of abuse instead of minutes, a bounded "
        "number of fuzz examples).",
        "",
        f"Run: {mode}, {env['generated_at']}, nulltickets {env['nulltickets']} at {commit}, "
        f"Python {env['python']}, SQLite {env['sqlite']}, {env['platform']} with "
        f"{env['cpus']} cores.",
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


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    doc = json.loads(Path(argv[1]).read_text(encoding="utf-8"))
    Path(argv[2]).write_text(render(doc), encoding="utf-8")
    print(f"{argv[2]}: {len(doc['rows'])} results", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
