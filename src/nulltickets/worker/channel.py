"""The private channel between `nulltickets worker` and the command it runs for one run.

The worker makes a directory of the run's own (mode 0700, removed after the run) and names it
in NULLTICKETS_RUN_DIR. It holds the claimed task (task.json) and its checkpoint
(checkpoint.json); `nulltickets transition` and `nulltickets fail`, run from inside the command,
write there the outcome the command chose (outcome.json), and the worker acts on it once the
command has exited. This is the only way a command chooses its outcome: what it prints is a log.

It also holds what an agent the command starts needs for its tools: the run's lease
(lease.json, mode 0600) and an MCP configuration (mcp.json, named in NULLTICKETS_MCP_CONFIG)
that starts `nulltickets mcp --run`, the tools bound to this run (mcp/run.py), which record the
agent's choice here the same way, through `choose`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import msgspec

ENV_RUN_DIR = "NULLTICKETS_RUN_DIR"
TASK_FILE = "task.json"
CHECKPOINT_FILE = "checkpoint.json"
OUTCOME_FILE = "outcome.json"
LEASE_FILE = "lease.json"
MCP_CONFIG_FILE = "mcp.json"
ENV_MCP_CONFIG = "NULLTICKETS_MCP_CONFIG"
MCP_SERVER_NAME = "nulltickets"
MAX_REASON = 4000  # characters of a failure's reason kept
MAX_OUTCOME_BYTES = 64 * 1024  # an outcome file larger than this is not read


class Transition(msgspec.Struct, tag="transition", forbid_unknown_fields=True):
    """Move the task along `trigger` when the command exits with status 0."""

    trigger: str


class Fail(msgspec.Struct, tag="fail", forbid_unknown_fields=True):
    """Fail the attempt with `error`, whatever the command's exit status."""

    error: str


Choice = Transition | Fail


class Lease(msgspec.Struct, forbid_unknown_fields=True):
    """The run's lease: what the tools bound to the run act under. `lease_token` is a secret
    (the file is the run's own, mode 0600): it never enters a tool's answer."""

    base_url: str
    task_id: str
    run_id: str
    lease_id: str
    lease_token: str
    fence: int


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(Choice).decode


class NotInRun(Exception):
    """Not inside a command run by `nulltickets worker`, or its run is over."""


def run_dir() -> Path:
    """The run directory of the command this process belongs to; raises NotInRun."""
    name = os.environ.get(ENV_RUN_DIR)
    if not name:
        raise NotInRun(f"{ENV_RUN_DIR} is not set: run this inside `nulltickets worker`")
    path = Path(name)
    if not path.is_dir():
        raise NotInRun(f"{ENV_RUN_DIR} names no directory ({name}): the run is over")
    return path


def choose(choice: Choice, directory: Path | None = None) -> None:
    """Record `choice` as the run's outcome (the last one recorded wins); raises NotInRun."""
    where = directory if directory is not None else run_dir()
    fd, tmp = tempfile.mkstemp(prefix=".outcome-", dir=where)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_encode(choice))
        os.replace(tmp, where / OUTCOME_FILE)  # whole or not at all, for the worker
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def task_of(directory: Path) -> Any:
    """The claimed task, as JSON (what the command read on stdin)."""
    return msgspec.json.decode((directory / TASK_FILE).read_bytes())


class NotATransition(ValueError):
    """A trigger the claimed task's stage does not have."""


def check_trigger(directory: Path, trigger: str) -> None:
    """Raise NotATransition when the claimed task names its stage's triggers and `trigger` is
    none of them. An unreadable task checks nothing: the server's answer to the worker decides
    then."""
    try:
        task = task_of(directory)
        stage = task["stage"]
        triggers = sorted({t["trigger"] for t in task["available_transitions"]})
    except (OSError, ValueError, KeyError, TypeError):
        return
    if triggers and trigger not in triggers:
        raise NotATransition(
            f"{trigger!r} is not a transition of stage {stage!r}: one of {', '.join(triggers)}"
        )


def lease_of(directory: Path) -> Lease:
    """The run's lease; raises NotInRun when the directory holds none (the run is over)."""
    try:
        return msgspec.json.decode((directory / LEASE_FILE).read_bytes(), type=Lease)
    except FileNotFoundError:
        raise NotInRun(f"{directory} holds no lease: the run is over") from None
    except (OSError, msgspec.DecodeError) as exc:
        raise NotInRun(f"the run's lease is not readable: {exc}") from None


def mcp_config(command: list[str], directory: Path) -> dict[str, Any]:
    """The `mcpServers` configuration that starts the tools bound to the run in `directory`.
    It names the directory in the server's environment: MCP clients (the SDKs, Codex) start a
    server with a few variables of their own only, not the command's whole environment."""
    program, *args = command
    server = {
        "command": program,
        "args": [*args, "mcp", "--run"],
        "env": {ENV_RUN_DIR: str(directory)},
    }
    return {"mcpServers": {MCP_SERVER_NAME: server}}


class RunDirectory:
    """The worker's side: the directory of one run, made private and removed when done."""

    def __init__(self, task_json: bytes, checkpoint_json: bytes) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="nulltickets-run-"))  # mode 0700
        self.task_file = self.path / TASK_FILE
        self.checkpoint_file = self.path / CHECKPOINT_FILE
        self.mcp_config_file: Path | None = None
        self.task_file.write_bytes(task_json)
        self.checkpoint_file.write_bytes(checkpoint_json)

    def offer_tools(self, lease: Lease, command: list[str]) -> None:
        """Write the run's lease and the MCP configuration that starts `command mcp --run`."""
        fd = os.open(self.path / LEASE_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(_encode(lease))
        self.mcp_config_file = self.path / MCP_CONFIG_FILE
        config = mcp_config(command, self.path)
        self.mcp_config_file.write_bytes(msgspec.json.format(_encode(config)))

    def __enter__(self) -> RunDirectory:
        return self

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def env(self) -> dict[str, str]:
        env = {
            ENV_RUN_DIR: str(self.path),
            "NULLTICKETS_TASK_FILE": str(self.task_file),
            "NULLTICKETS_CHECKPOINT_FILE": str(self.checkpoint_file),
        }
        if self.mcp_config_file is not None:
            env[ENV_MCP_CONFIG] = str(self.mcp_config_file)
        return env

    def chosen(self) -> Choice | None:
        """What the command chose, or None; ValueError when its choice cannot be read."""
        path = self.path / OUTCOME_FILE
        try:
            with path.open("rb") as f:
                raw = f.read(MAX_OUTCOME_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ValueError(f"outcome not readable: {exc}") from None
        if len(raw) > MAX_OUTCOME_BYTES:
            raise ValueError(f"outcome larger than {MAX_OUTCOME_BYTES} bytes")
        try:
            choice: Choice = _decode(raw)
        except msgspec.DecodeError as exc:
            raise ValueError(f"outcome not readable: {exc}") from None
        return choice
