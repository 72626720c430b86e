"""What must hold in a database file whatever happened to the server or its agents, and the check
that everything an agent was told "yes" to is in it.

Each check returns a list of problems (empty: fine), so a test can report them all at once.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from tests.reliability.helpers import Journals, open_db, rows

RETRY_EVENTS = ("retry_scheduled", "dead_letter")


def _json(text: str) -> Any:
    return json.loads(text)


def check_tasks(db: Path | str, definition: dict[str, Any]) -> tuple[list[str], dict[str, int]]:
    """Every task is in exactly one stage of its pipeline, the one its own history leads to;
    no task left a stage twice on one attempt (no double completion); the version counts the
    moves; every run's status agrees with its events; leases and running runs pair up."""
    problems: list[str] = []
    states = definition["states"]
    initial = definition["initial"]
    edges = {(t["from"], t["to"]) for t in definition["transitions"]}
    with open_db(db) as conn:
        tasks = rows(
            conn,
            "SELECT id, stage, task_version, dead_letter_reason, dead_letter_stage FROM tasks",
        )
        runs = rows(conn, "SELECT id, task_id, attempt, status FROM runs")
        events = rows(
            conn,
            "SELECT e.id, e.run_id, e.kind, e.data_json, r.task_id, r.attempt FROM events AS e"
            " JOIN runs AS r ON r.id = e.run_id ORDER BY e.id",
        )
        leases = rows(conn, "SELECT id, run_id, expires_at_ms FROM leases")
    run_of = {r[0]: r for r in runs}
    by_task: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
    by_run: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
    for e in events:
        by_task[e[4]].append(e)
        by_run[e[1]].append(e)

    # Exactly one stage, the one its transitions and dead-lettering lead to.
    left: dict[tuple[str, int, str], int] = defaultdict(int)
    for task_id, stage, version, reason, dl_stage in tasks:
        if stage not in states:
            problems.append(f"task {task_id} is in {stage!r}, not a stage of its pipeline")
        current, moves = initial, 0
        for _eid, run_id, kind, data_json, _t, attempt in by_task[task_id]:
            data = _json(data_json)
            if kind == "transition":
                left[(task_id, attempt, data["from"])] += 1
                if data["from"] != current or (data["from"], data["to"]) not in edges:
                    problems.append(
                        f"task {task_id}: transition {data['from']}->{data['to']} "
                        f"(run {run_id}) while in {current}"
                    )
                current, moves = data["to"], moves + 1
            elif kind == "dead_letter":
                if data["from_stage"] != current:
                    problems.append(f"task {task_id}: dead-lettered from {data['from_stage']}")
                if data["dead_letter_stage"] is not None:
                    current, moves = data["dead_letter_stage"], moves + 1
        if stage != current:
            problems.append(f"task {task_id} is in {stage} but its history leads to {current}")
        if version != 1 + moves:
            problems.append(f"task {task_id} has version {version} after {moves} moves")
        dead_events = [e for e in by_task[task_id] if e[2] == "dead_letter"]
        if (reason is not None) != bool(dead_events) or len(dead_events) > 1:
            problems.append(f"task {task_id}: reason {reason!r} with {len(dead_events)} DL events")
        if reason is not None and dl_stage is not None and stage != dl_stage:
            problems.append(f"dead-lettered task {task_id} is in {stage}, not {dl_stage}")
    for (task_id, attempt, stage), n in left.items():
        if n > 1:
            problems.append(f"task {task_id} left {stage} {n} times on attempt {attempt}")

    # Runs agree with their events.
    counts: dict[str, int] = defaultdict(int)
    for run_id, _task_id, _attempt, status in runs:
        counts[status] += 1
        kinds = [e[2] for e in by_run[run_id]]
        transitions = kinds.count("transition")
        retries = sum(kinds.count(k) for k in RETRY_EVENTS)
        if transitions > 1:
            problems.append(f"run {run_id} has {transitions} transition events")
        if status == "completed" and transitions != 1:
            problems.append(f"completed run {run_id} has {transitions} transition events")
        if status in ("failed", "stale") and (transitions or retries != 1):
            problems.append(f"{status} run {run_id}: {kinds}")
        if status == "stale" and kinds.count("lease_expired") != 1:
            problems.append(f"stale run {run_id} without its lease_expired event: {kinds}")
        if status == "running" and (transitions or retries):
            problems.append(f"running run {run_id} already has {kinds}")

    # No orphan lease, no orphan run.
    running = {r[0] for r in runs if r[3] == "running"}
    leased: dict[str, int] = defaultdict(int)
    for lease_id, run_id, _expires in leases:
        leased[run_id] += 1
        if run_id not in run_of:
            problems.append(f"lease {lease_id} of missing run {run_id}")
        elif run_of[run_id][3] != "running":
            problems.append(f"lease {lease_id} of {run_of[run_id][3]} run {run_id}")
    for run_id in running:
        if leased[run_id] != 1:
            problems.append(f"running run {run_id} has {leased[run_id]} leases")
    per_task: dict[str, int] = defaultdict(int)
    for run_id in running:
        per_task[run_of[run_id][1]] += 1
    problems.extend(f"task {t} has {n} running runs" for t, n in per_task.items() if n > 1)
    summary = {
        "tasks": len(tasks),
        "runs": len(runs),
        "events": len(events),
        "leases": len(leases),
        **{f"runs_{k}": v for k, v in counts.items()},
        "dead_lettered": sum(1 for t in tasks if t[3] is not None),
    }
    return problems, summary


def check_acknowledged(db: Path | str, journals: Journals) -> tuple[list[str], int]:
    """Every answer an agent took as success is in the file. Returns (problems, acks checked)."""
    lost, checked = acknowledged_lost(db, journals)
    return [message for message, _entry in lost], checked


def acknowledged_lost(db: Path, journals: Journals) -> tuple[list[tuple[str, dict[str, Any]]], int]:
    """The answers an agent took as success that are not in the file, each with its journal
    entry (whose `t` says when it was acknowledged); and how many were checked."""
    problems: list[tuple[str, dict[str, Any]]] = []
    checked = 0
    with open_db(db) as conn:
        runs = {r[0]: r for r in rows(conn, "SELECT id, task_id, attempt, status FROM runs")}
        events = {r[0]: r for r in rows(conn, "SELECT id, run_id, kind, data_json FROM events")}
        kinds: dict[str, list[str]] = defaultdict(list)
        moves: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for _eid, run_id, kind, data_json in events.values():
            kinds[run_id].append(kind)
            if kind == "transition":
                moves[run_id].append(_json(data_json))
        store = {
            (ns, key): _json(value)
            for ns, key, value in rows(conn, "SELECT namespace, key, value_json FROM store")
        }
    for e in journals.ops("claim"):
        checked += 1
        run = runs.get(e["run"])
        if run is None or (run[1], run[2]) != (e["task"], e["attempt"]):
            problems.append((f"acknowledged claim lost: {e}", e))
    for e in journals.ops("event"):
        checked += 1
        row = events.get(e["id"])
        if row is None or row[1] != e["run"] or row[2] != e["kind"] or _json(row[3]) != e["data"]:
            problems.append((f"acknowledged event lost or changed: {e} -> {row}", e))
    for e in journals.ops("transition"):
        checked += 1
        run = runs.get(e["run"])
        wanted = [m for m in moves[e["run"]] if (m["from"], m["to"]) == (e["from"], e["to"])]
        if run is None or run[3] != "completed" or len(wanted) != 1:
            problems.append((f"acknowledged transition lost: {e} (run {run})", e))
    for e in journals.ops("fail"):
        checked += 1
        run = runs.get(e["run"])
        if run is None or run[3] != "failed" or not set(kinds[e["run"]]) & set(RETRY_EVENTS):
            problems.append((f"acknowledged failure lost: {e} (run {run})", e))
    # The store: the last acknowledged put or delete of a key decides, unless a later request
    # on that key went out unanswered (then either state is right).
    last: dict[tuple[str, str], tuple[str, Any, dict[str, Any]]] = {}
    for e in journals.entries:
        op, k = e.get("op"), (str(e.get("ns")), str(e.get("key")))
        if op in ("put_sent", "delete_sent"):
            last[k] = ("unsure", None, e)
        elif op == "put":
            last[k] = ("present", e["value"], e)
        elif op == "delete":
            last[k] = ("absent", None, e)
    for (ns, key), (state, value, e) in last.items():
        if state == "unsure":
            continue
        checked += 1
        got = store.get((ns, key), "<absent>")
        if state == "present" and got != value:
            problems.append((f"acknowledged put {ns}/{key} lost: {got!r} != {value!r}", e))
        if state == "absent" and got != "<absent>":
            problems.append((f"acknowledged delete {ns}/{key} undone: {got!r}", e))
    return problems, checked
