"""`/mcp` driven by a second, independent client: the TypeScript MCP SDK's own
(`@modelcontextprotocol/sdk`, pinned in tests/mcp_ts/package-lock.json) over Streamable HTTP,
against a server process. tests/mcp_ts/loop.mjs lists the tools, claims, saves a checkpoint and
transitions; the tracker's API then says what happened.

Node and the SDK come from `make test-tools` (scripts/test-tools.sh: the distribution's nodejs
and npm, then `npm ci` in tests/mcp_ts); without them these tests fail, saying so."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import make_task, module_server, server_dsn, task, unique
from tests.server import TIME_SCALE, Client, Server

pytestmark = [pytest.mark.e2e, pytest.mark.process]

TOKEN = "mcp-ts-root-token-0123456789"
LOOP = Path(__file__).resolve().parent.parent / "mcp_ts"
# Written by scripts/test-tools.sh after `npm ci`: the lock the installed modules came from.
INSTALLED = LOOP / "node_modules" / ".installed-lock.json"
LOOP_TOOLS = ("claim_task", "save_checkpoint", "transition_task")


@pytest.fixture(scope="module")
def node() -> str:
    found = shutil.which("node")
    if found is None:
        pytest.fail("node is needed: run `make test-tools` (scripts/test-tools.sh)", pytrace=False)
    lock = (LOOP / "package-lock.json").read_bytes()
    if not INSTALLED.exists() or INSTALLED.read_bytes() != lock:
        pytest.fail(
            "tests/mcp_ts has not installed its locked modules: run `make test-tools` "
            "(scripts/test-tools.sh runs `npm ci` there)",
            pytrace=False,
        )
    return found


@pytest.fixture
def secured(request: pytest.FixtureRequest) -> Server:
    return module_server(request, "mcp-ts", token=TOKEN, dsn=server_dsn(request))


@pytest.fixture
def admin(secured: Server) -> Iterator[Client]:
    c = secured.client(TOKEN)
    yield c
    c.close()


def one_stage_pipeline(admin: Client, role: str) -> str:
    definition = {
        "initial": "todo",
        "states": {"todo": {"agent_role": role}, "done": {"terminal": True}},
        "transitions": [{"from": "todo", "to": "done", "trigger": "complete"}],
    }
    r = admin.post("/pipelines", {"name": unique("pipe"), "definition": definition})
    assert r.status == 201, r.body
    return str(r.json["id"])


def agent_key(admin: Client, role: str) -> dict[str, Any]:
    r = admin.post("/keys", {"name": unique("key"), "access": "agent", "roles": [role]})
    assert r.status == 201, r.body
    return dict(r.json)


def run_loop(
    node: str, server: Server, role: str, checkpoint: Any, key: str | None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "NULLTICKETS_KEY"}
    if key is not None:
        env["NULLTICKETS_KEY"] = key
    return subprocess.run(
        [
            node,
            str(LOOP / "loop.mjs"),
            f"{server.base}/mcp",
            role,
            "complete",
            json.dumps(checkpoint),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60 * TIME_SCALE,
    )


def keys_named(value: Any) -> set[str]:
    if isinstance(value, dict):
        return set(value).union(*(keys_named(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(keys_named(v) for v in value))
    return set()


def test_the_typescript_sdk_claims_checkpoints_and_transitions(
    node: str, secured: Server, admin: Client
) -> None:
    role = unique("coder")
    task_id = make_task(admin, one_stage_pipeline(admin, role), description="port the parser")
    key = agent_key(admin, role)
    checkpoint = {"step": 3, "notes": ["lexer done"], "from": "typescript"}

    done = run_loop(node, secured, role, checkpoint, key["key"])
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)

    assert seen["server"]["name"] == "nulltickets"
    assert set(LOOP_TOOLS) <= set(seen["tools"])
    assert "create_pipeline" not in seen["tools"]  # an agent key sees no operator's tool
    for name in LOOP_TOOLS:
        assert seen["schemas"][name]["type"] == "object", seen["schemas"][name]
    assert seen["schemas"]["save_checkpoint"]["required"] == ["checkpoint"]
    assert seen["schemas"]["transition_task"]["required"] == ["trigger"]

    claim = seen["claim"]
    assert claim["claimed"] is True
    assert claim["task"]["id"] == task_id
    assert claim["task"]["checkpoint"] is None
    assert [t["trigger"] for t in claim["task"]["available_transitions"]] == ["complete"]
    assert seen["claim_text"].startswith("UNTRUSTED CONTENT")
    assert seen["checkpoint"]["checkpoint"] == checkpoint
    assert seen["transition"] == {
        "previous_stage": "todo",
        "new_stage": "done",
        "trigger": "complete",
    }
    # The lease ended with the transition: the next tool on it is a tool error, not a crash.
    assert seen["after_transition"]["isError"] is True
    assert seen["after_transition"]["structured"]["error"]["code"] == "no_task_held"
    # No lease token ever reached the client, nor the key it presented.
    assert not {"lease_token", "token"} & keys_named(seen)
    assert key["key"] not in done.stdout

    # The tracker's own API: the task moved, the run ended, the checkpoint is stored.
    details = task(admin, task_id)
    assert details["stage"] == "done"
    assert details["checkpoint"] == checkpoint
    run = details["latest_run"]
    assert run["id"] == claim["run_id"]
    assert run["status"] == "completed"
    assert run["agent_id"] == f"mcp-{key['id']}"
    assert run["agent_role"] == role


def test_the_typescript_sdk_without_a_key_is_refused(
    node: str, secured: Server, admin: Client
) -> None:
    role = unique("coder")
    task_id = make_task(admin, one_stage_pipeline(admin, role))

    refused = run_loop(node, secured, role, {"step": 1}, None)
    assert refused.returncode == 1
    assert '"code":"unauthorized"' in refused.stderr, refused.stderr
    assert task(admin, task_id).get("latest_run") is None


def test_the_typescript_sdk_with_a_key_for_another_role_claims_nothing(
    node: str, secured: Server, admin: Client
) -> None:
    role, other = unique("coder"), unique("coder")
    task_id = make_task(admin, one_stage_pipeline(admin, role))

    refused = run_loop(node, secured, role, {"step": 1}, agent_key(admin, other)["key"])
    assert refused.returncode == 1
    assert "claim_task answered an error" in refused.stderr, refused.stderr
    assert '"code":"forbidden"' in refused.stderr, refused.stderr
    assert task(admin, task_id).get("latest_run") is None
