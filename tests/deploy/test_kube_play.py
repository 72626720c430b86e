"""deploy/kube/nulltickets.yaml brought up with `podman kube play`: PostgreSQL, two servers and
HAProxy in front, as the file is written (only the published port is this machine's choice).

Twelve agents work through the tasks, every request through HAProxy, while one server's
container is killed mid-run. Then every task is done exactly once and every transition an agent
was told succeeded is in the database.

Opt-in: `make test-deploy` (scripts/deploy-test.sh builds the server's image and the stand-ins
for the registry's postgres and haproxy images first, and sets podman up for this machine).
"""

from __future__ import annotations

import http.client
import re
import secrets
import shutil
import socket
import subprocess
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import unique, wait_for
from tests.finishing_agent import FinishingAgent
from tests.server import Client, Response

pytestmark = [pytest.mark.process, pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "deploy" / "kube" / "nulltickets.yaml"
AGENTS = 12
TASKS = 200
LEASE_TTL_MS = 2000
# Container names podman gives the manifest's pods: <pod>-<container>.
POSTGRES = "postgres-postgres"
DOOMED = "nulltickets-a-server"
SERVERS = ("nulltickets-a-server", "nulltickets-b-server")
# What HAProxy answers while a server is going or gone: the agent asks again.
PROXY_GAPS = (502, 503, 504)


def podman(*args: str, check: bool = True, timeout: float = 300) -> str:
    tool = shutil.which("podman")
    assert tool is not None, "podman is missing: run `make test-deploy`"
    done = subprocess.run([tool, *args], capture_output=True, text=True, timeout=timeout)
    if check:
        assert done.returncode == 0, f"podman {' '.join(args)}:\n{done.stdout}{done.stderr}"
    return done.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def secret(manifest: str, key: str) -> str:
    found = re.search(rf"^\s+{key}: (\S+)$", manifest, re.MULTILINE)
    assert found is not None, key
    return found.group(1)


def sql(query: str) -> list[str]:
    out = podman("exec", POSTGRES, "psql", "-U", "nulltickets", "-d", "nulltickets", "-Atc", query)
    return out.splitlines()


@dataclass
class Stack:
    port: int
    token: str

    def client(self, timeout: float = 15) -> Client:
        return Client("127.0.0.1", self.port, token=self.token, timeout=timeout)


def down(manifest: Path) -> None:
    podman("kube", "down", str(manifest), check=False)
    podman("volume", "rm", "-f", "nulltickets-postgres", check=False)
    podman("secret", "rm", "nulltickets", check=False)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    text = MANIFEST.read_text()
    port = free_port()
    assert text.count("hostPort: 7700") == 1
    manifest = tmp_path / "nulltickets.yaml"
    # The secrets set as the file says a user must: its placeholders do not start a server.
    assert secret(text, "token") == "CHANGE-ME-TOKEN"
    text = text.replace("CHANGE-ME-TOKEN", secrets.token_hex(24))
    text = text.replace("CHANGE-ME-PASSWORD", secrets.token_hex(24))
    manifest.write_text(text.replace("hostPort: 7700", f"hostPort: {port}"))
    for image in re.findall(r"^\s+image: (\S+)$", text, re.MULTILINE):
        podman("image", "exists", image)  # built here; nothing is pulled
    network = f"nulltickets-test-{uuid.uuid4().hex[:8]}"
    down(manifest)  # what an interrupted run left
    podman("network", "create", network)
    try:
        podman("kube", "play", "--network", network, str(manifest))
        stack = Stack(port, secret(text, "token"))

        # HAProxy counts a server up before its first check and then down until two checks a
        # second apart pass (rise 2, inter 1s): one answer can come before both are up, so the
        # stack is ready after answers through HAProxy for 3 s on end.
        streak = [0]

        def healthy() -> bool:
            try:
                ok = stack.client(timeout=5).get("/health").status == 200
            except (OSError, http.client.HTTPException):
                ok = False
            streak[0] = streak[0] + 1 if ok else 0
            return streak[0] >= 7

        wait_for("the servers answering through HAProxy", healthy, timeout=180, interval=0.5)
        yield stack
    finally:
        for name in (*SERVERS, POSTGRES, "nulltickets-lb-haproxy"):
            logs = podman("logs", "--tail", "20", name, check=False)
            print(f"--- {name}\n{logs}")
        down(manifest)
        podman("network", "rm", "-f", network, check=False)


def lease_gone(r: Response) -> bool:
    """The lease expired while its agent's request was on the way (a server died mid-request,
    a retry came late) and the reaper ended it: the task is someone else's now."""
    return r.status == 404 and b"No active lease" in r.body


class Agent(FinishingAgent):
    """Always through HAProxy, which answers 502-504 for a request its server died on, and
    may pass on a transition whose lease expired meanwhile."""

    def __init__(self, name: str, role: str, stack: Stack) -> None:
        super().__init__(name, role, LEASE_TTL_MS)
        self.stack = stack

    def client(self) -> Client:
        return self.stack.client()

    def explained(self, r: Response) -> bool:
        return r.status in PROXY_GAPS or lease_gone(r)


def test_two_servers_behind_haproxy_one_killed_every_task_done_once(stack: Stack) -> None:
    role = unique("coder")
    admin = stack.client()
    definition = {
        "initial": "todo",
        "states": {"todo": {"agent_role": role}, "done": {"terminal": True}},
        "transitions": [{"from": "todo", "to": "done", "trigger": "finish"}],
    }
    r = admin.post("/pipelines", {"name": unique("pipe"), "definition": definition})
    assert r.status == 201, r.body
    tasks = [
        {"pipeline_id": r.json["id"], "title": f"t{i}", "description": ""} for i in range(TASKS)
    ]
    created: list[str] = []
    for start in range(0, TASKS, 50):
        r = admin.post("/tasks/bulk", {"tasks": tasks[start : start + 50]})
        assert r.status == 201, r.body
        created += r.json["ids"]
    admin.close()

    agents = [Agent(f"agent-{i}", role, stack) for i in range(AGENTS)]
    for a in agents:
        a.start()

    def done() -> int:
        return int(sql("SELECT count(*) FROM tasks WHERE stage = 'done'")[0])

    wait_for("a tenth of the tasks done", lambda: done() >= TASKS // 10, timeout=120, interval=0.2)
    # Both servers have been working (HAProxy's log names the server of every request).
    served = podman("logs", "nulltickets-lb-haproxy")
    assert "servers/a " in served and "servers/b " in served
    podman("kill", DOOMED)  # SIGKILL, mid-run: HAProxy sends its agents to the other
    wait_for("every task done", lambda: done() == TASKS, timeout=300, interval=0.5)
    for a in agents:
        a.stop_when_idle.set()
    for a in agents:
        a.join(60)
    assert [u for a in agents for u in a.unexpected] == []
    assert podman("inspect", "--format", "{{.State.Running}}", DOOMED).strip() == "false"

    # Every task done exactly once: one completed run each, in the final stage.
    completed = Counter(sql("SELECT task_id FROM runs WHERE status = 'completed'"))
    assert completed == Counter(created)
    assert sql("SELECT count(*) FROM runs WHERE status = 'running'") == ["0"]
    assert sql("SELECT count(*) FROM leases") == ["0"]
    # No acknowledged transition lost, none acknowledged twice.
    acknowledged = [entry for a in agents for entry in a.acknowledged]
    assert len({task for task, _ in acknowledged}) == len(acknowledged)
    kept = {
        tuple(line.split("|"))
        for line in sql("SELECT task_id, id FROM runs WHERE status = 'completed'")
    }
    assert set(acknowledged) <= kept
