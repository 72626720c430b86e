"""An agent process for the reliability suites: claim -> events -> transition or fail, again and
again, and a journal (one JSON line per acknowledged answer) of everything the server said yes to.

    python -m tests.reliability.agent --port P --agent-id A --journal F [options]

Every write carries an Idempotency-Key; when the server is unreachable (killed, restarting) the
same request is sent again with the same key until --retry-s runs out, which is what a careful
agent does and what lets the crash suite count on "acknowledged" meaning "committed". A task whose
title contains --poison makes the agent SIGKILL itself right after claiming it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from tests.server import Client, Response


class Agent:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.name: str = args.agent_id
        self.client = Client("127.0.0.1", args.port, timeout=args.request_timeout)
        self.rng = random.Random(args.seed if args.seed is not None else uuid.uuid4().int)
        self.journal = open(args.journal, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
        self.stats: Counter[str] = Counter()
        self.latencies: list[float] = []
        self.started = time.monotonic()
        self.stored: list[str] = []

    # --- plumbing ------------------------------------------------------------------------------

    def note(self, op: str, **fields: Any) -> None:
        """One journal line, written through to the kernel before going on (a SIGKILL later
        cannot take it back)."""
        self.journal.write(json.dumps({"op": op, "t": time.time_ns() // 1_000_000, **fields}))
        self.journal.write("\n")
        self.journal.flush()

    def call(
        self,
        what: str,
        method: str,
        path: str,
        body: Any = None,
        token: str | None = None,
        key: bool = True,
    ) -> Response | None:
        """Send until answered (same Idempotency-Key every time); None when the server stayed
        unreachable for --retry-s."""
        headers = {"Idempotency-Key": str(uuid.uuid4())} if key and method != "GET" else {}
        if self.args.token and token is None:
            token = self.args.token
        deadline = time.monotonic() + self.args.retry_s
        busy_waits = 0
        while True:
            start = time.perf_counter()
            try:
                r = self.client.request(method, path, body, headers=headers, token=token)
            except (OSError, http.client.HTTPException):
                self.stats["connection_errors"] += 1
                self.client.close()
                if time.monotonic() > deadline:
                    self.stats["gave_up"] += 1
                    return None
                time.sleep(0.05)
                continue
            if self.args.latency:
                self.latencies.append(round((time.perf_counter() - start) * 1000, 3))
            self.stats[f"{what}:{r.status}"] += 1
            if r.status == 503 and busy_waits < 20 and time.monotonic() < deadline:
                busy_waits += 1
                time.sleep(min(float(r.headers.get("retry-after", "1") or 1), 1.0))
                continue
            if r.status >= 500:
                self.stats["server_errors"] += 1
                self.note("server_error", what=what, status=r.status, body=r.body.decode()[:300])
            return r

    def refused(self, what: str, r: Response | None, **fields: Any) -> None:
        if r is None:
            self.note("unanswered", what=what, **fields)
            return
        code = ""
        try:
            code = r.json["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = r.body.decode(errors="replace")[:100]
        self.note("refused", what=what, status=r.status, code=code, **fields)

    def should_stop(self) -> bool:
        if self.args.stop_file and Path(self.args.stop_file).exists():
            return True
        return bool(time.monotonic() - self.started > self.args.deadline_s)

    # --- the work ------------------------------------------------------------------------------

    def run(self) -> None:
        roles = self.args.roles.split(",")
        idle_since: float | None = None
        turn = 0
        while not self.should_stop():
            role = roles[turn % len(roles)]
            turn += 1
            outcome = self.cycle(role)
            if outcome == "gone":
                break
            if outcome == "idle":
                idle_since = idle_since or time.monotonic()
                if self.args.idle_exit_s and time.monotonic() - idle_since > self.args.idle_exit_s:
                    break
                time.sleep(self.args.idle_ms / 1000)
            else:
                idle_since = None
                if self.args.think_ms:
                    time.sleep(self.args.think_ms / 1000)
        self.finish()

    def cycle(self, role: str) -> str:
        body = {"agent_id": self.name, "agent_role": role, "lease_ttl_ms": self.args.lease_ttl_ms}
        r = self.call("claim", "POST", "/leases/claim", body, key=self.args.claim_key)
        if r is None:
            return "gone"
        if r.status == 204:
            return "idle"
        if r.status != 200:
            self.refused("claim", r)
            return "refused"
        doc = r.json
        task, run = doc["task"], doc["run"]
        token, run_id = doc["lease_token"], run["id"]
        self.note(
            "claim",
            task=task["id"],
            run=run_id,
            lease=doc["lease_id"],
            attempt=run["attempt"],
            stage=task["stage"],
            version=task["task_version"],
            expires=doc["expires_at_ms"],
            title=task["title"],
        )
        if self.args.poison and self.args.poison in task["title"]:
            self.note("poisoned", task=task["id"], run=run_id)
            os.kill(os.getpid(), signal.SIGKILL)

        for n in range(self.args.events):
            data = {"agent": self.name, "n": n, "pct": (n + 1) * 100 // self.args.events}
            e = self.call(
                "event", "POST", f"/runs/{run_id}/events", {"kind": "progress", "data": data}, token
            )
            if e is None or e.status != 201:
                self.refused("event", e, run=run_id)
                return "refused"
            self.note("event", run=run_id, id=e.json["id"], kind="progress", data=data)

        if self.args.work_ms:
            self.note("working", run=run_id, task=task["id"])
            if not self.work(doc["lease_id"], run_id, token):
                return "refused"

        if self.rng.random() < self.args.fail_ratio:
            f = self.call(
                "fail", "POST", f"/runs/{run_id}/fail", {"error": f"{self.name} gave up"}, token
            )
            if f is None or f.status != 200:
                self.refused("fail", f, run=run_id)
                return "refused"
            self.note("fail", run=run_id, task=task["id"])
            return "failed"

        trigger = self.trigger(task)
        move = {"trigger": trigger, "expected_task_version": task["task_version"]}
        t = self.call("transition", "POST", f"/runs/{run_id}/transition", move, token)
        if t is None or t.status != 200:
            self.refused("transition", t, run=run_id)
            return "refused"
        result = t.json
        self.note(
            "transition",
            run=run_id,
            task=task["id"],
            trigger=trigger,
            **{"from": result["previous_stage"], "to": result["new_stage"]},
        )
        if self.args.store:
            self.store(task["id"])
        return "done"

    def work(self, lease_id: str, run_id: str, token: str) -> bool:
        """Spend --work-ms on the task, heartbeating (with --heartbeat) at a third of the TTL."""
        end = time.monotonic() + self.args.work_ms / 1000
        beat = self.args.lease_ttl_ms / 3000
        while time.monotonic() < end:
            time.sleep(max(0.0, min(beat, end - time.monotonic())))
            if self.args.heartbeat and time.monotonic() < end:
                h = self.call("heartbeat", "POST", f"/leases/{lease_id}/heartbeat", None, token)
                if h is None or h.status != 200:
                    self.refused("heartbeat", h, run=run_id)
                    return False
                self.note("heartbeat", run=run_id, lease=lease_id, expires=h.json["expires_at_ms"])
        return True

    def trigger(self, task: dict[str, Any]) -> str:
        moves = task.get("available_transitions") or []
        if moves:
            return str(moves[0]["trigger"])
        table = dict(pair.split("=", 1) for pair in self.args.triggers.split(",") if pair)
        return str(table[task["stage"]])

    def store(self, task_id: str) -> None:
        """Record the result in the shared store, and now and then forget an older one."""
        key = f"{self.name}-{len(self.stored)}"
        value = {"task": task_id, "note": f"finished by {self.name} word{len(self.stored) % 50}"}
        self.note("put_sent", ns="results", key=key)
        p = self.call("put", "PUT", f"/store/results/{key}", {"value": value})
        if p is None or p.status != 204:
            self.refused("put", p, key=key)
            return
        self.note("put", ns="results", key=key, value=value)
        self.stored.append(key)
        if len(self.stored) > 3 and self.rng.random() < 0.3:
            old = self.stored[self.rng.randrange(len(self.stored) - 1)]
            self.note("delete_sent", ns="results", key=old)
            d = self.call("delete", "DELETE", f"/store/results/{old}")
            if d is None or d.status != 204:
                self.refused("delete", d, key=old)
                return
            self.note("delete", ns="results", key=old)

    def finish(self) -> None:
        self.note("exit", stats=dict(self.stats), latencies_ms=self.latencies)
        self.journal.close()
        self.client.close()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.reliability.agent")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--agent-id", required=True)
    p.add_argument("--journal", required=True)
    p.add_argument("--roles", default="coder")
    p.add_argument("--triggers", default="todo=submit,review=approve")
    p.add_argument("--token", default=None, help="admin token, when the server has one")
    p.add_argument("--lease-ttl-ms", type=int, default=5000)
    p.add_argument("--events", type=int, default=1)
    p.add_argument("--fail-ratio", type=float, default=0.0)
    p.add_argument("--work-ms", type=int, default=0)
    p.add_argument("--heartbeat", action="store_true")
    p.add_argument("--poison", default="")
    p.add_argument("--store", action="store_true")
    p.add_argument(
        "--claim-key",
        action="store_true",
        help="claims carry an Idempotency-Key too (a lost answer is replayed, not re-claimed)",
    )
    p.add_argument("--latency", action="store_true")
    p.add_argument("--think-ms", type=int, default=0)
    p.add_argument("--idle-ms", type=int, default=50)
    p.add_argument("--idle-exit-s", type=float, default=0.0)
    p.add_argument("--stop-file", default="")
    p.add_argument("--deadline-s", type=float, default=300.0)
    p.add_argument("--retry-s", type=float, default=60.0)
    p.add_argument("--request-timeout", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=None)
    return p.parse_args(argv)


def main() -> None:
    Agent(parse()).run()


if __name__ == "__main__":
    main()
