"""The agent-side commands: `worker`, and the helpers a running command (in any language) calls.

    nulltickets worker --role R [--base URL] [--token T] -- COMMAND [ARG...]
    nulltickets checkpoint '{"step": 2}'        merge into the task's checkpoint
    nulltickets event KIND ['{"any": "json"}']  append an event to the current run
    nulltickets transition TRIGGER              the transition to take when the command exits 0
    nulltickets fail REASON                     fail the attempt when the command exits
    nulltickets pause --agent-id X              release whatever agent X holds (a Stop hook)
    nulltickets mcp [--role R] [--base URL]     the tools for an agent, on stdio (MCP)
    nulltickets mcp --run                       the tools of the worker's current run (MCP)

`checkpoint` and `event` read the run from the variables the worker sets (NULLTICKETS_RUN_ID,
NULLTICKETS_LEASE_TOKEN, NULLTICKETS_FENCE, NULLTICKETS_BASE_URL, NULLTICKETS_CHECKPOINT_FILE);
`transition` and `fail` write to the worker through the run's private directory
(NULLTICKETS_RUN_DIR, worker/channel.py): the worker acts on the choice once the command has
exited. `mcp --run` offers the same as tools, to an agent the command starts (the worker's
NULLTICKETS_MCP_CONFIG starts it); it is never implied: without --run, `mcp` is a session of
its own that claims its tasks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from nulltickets import worker
from nulltickets.client import ApiError, Client, remote
from nulltickets.client.calls import DEFAULT_BASE_URL
from nulltickets.client.remote import CommandFailed
from nulltickets.worker import channel


def register(commands: Any) -> None:
    """Add worker, mcp, checkpoint, event and pause to the `nulltickets` subcommands."""
    p = commands.add_parser(
        "mcp",
        help="serve the tools for an agent on stdio (MCP): claim, checkpoint, transition, ...",
        description="Serve nulltickets' tools to an MCP client (Claude Code, Codex, Cursor, ...) "
        "on stdin and stdout, as a client of the server at --base. The process is the "
        "session: the task it claims is held for it, kept alive while it runs, and released "
        "when stdin closes.",
    )
    env = os.environ.get
    p.add_argument(
        "--base",
        default=env("NULLTICKETS_BASE_URL", DEFAULT_BASE_URL),
        help="the server's URL (default: $NULLTICKETS_BASE_URL, else %(default)s)",
    )
    p.add_argument(
        "--key",
        default=env("NULLTICKETS_KEY") or env("NULLTICKETS_TOKEN"),
        help="the key to act with: an agent key for its roles, or a read key (default: "
        "$NULLTICKETS_KEY, else $NULLTICKETS_TOKEN); the environment keeps it out of ps",
    )
    p.add_argument("--role", default=None, help="the role claim_task claims for by default")
    p.add_argument(
        "--agent-id", default=None, help="the agent id claims are made as (default: mcp-HOST-PID)"
    )
    p.add_argument(
        "--run",
        action="store_true",
        help="serve the tools of the run of `nulltickets worker` this process is inside "
        "(NULLTICKETS_RUN_DIR): get_task, save_checkpoint, add_event, transition_task and "
        "fail_task on the task the worker claimed, under its lease; the worker acts on the "
        "chosen outcome when its command exits. --base, --key, --role and --agent-id do not "
        "apply",
    )
    p.set_defaults(func=mcp_command)

    p = commands.add_parser(
        "worker",
        help="run a command as an agent for each task claimed for a role",
        description="Claim tasks for ROLE one at a time and run COMMAND for each, with the "
        "task as JSON on stdin; exit 0 moves the task along, any other exit fails the attempt.",
    )
    worker.add_arguments(p)
    p.set_defaults(func=worker.main_from_args)

    p = commands.add_parser(
        "checkpoint",
        help="merge JSON into the current task's checkpoint (inside a worker's command)",
        description="Merge a JSON object (RFC 7396 merge patch) into the task's checkpoint. "
        "Run it inside `nulltickets worker`, which sets NULLTICKETS_RUN_ID and the lease.",
    )
    p.add_argument("patch", help="a JSON object, or - to read it from stdin")
    p.set_defaults(func=checkpoint_command)

    p = commands.add_parser(
        "event",
        help="append an event to the current run (inside a worker's command)",
        description="Append an event to the current run. Run it inside `nulltickets worker`.",
    )
    p.add_argument("kind", help="the event's kind, e.g. progress")
    p.add_argument("data", nargs="?", default=None, help="JSON data, or - to read it from stdin")
    p.set_defaults(func=event_command)

    p = commands.add_parser(
        "transition",
        help="choose the transition the task takes when the command exits 0 (inside a "
        "worker's command)",
        description="Choose the transition the task moves along when the command exits with "
        "status 0 (the last choice wins). Run it inside `nulltickets worker`; what the command "
        "prints never chooses.",
    )
    p.add_argument("trigger", help="one of the stage's triggers, e.g. approve")
    p.set_defaults(func=transition_command)

    p = commands.add_parser(
        "fail",
        help="fail the attempt with a reason when the command exits (inside a worker's command)",
        description="Fail the attempt with REASON when the command exits, whatever its exit "
        "status (the last choice wins); the task's retry policy decides what comes next. Run "
        "it inside `nulltickets worker`.",
    )
    p.add_argument("reason", help="why the attempt failed, or - to read it from stdin")
    p.set_defaults(func=fail_command)

    p = commands.add_parser(
        "pause",
        help="release every task an agent holds (a stop hook)",
        description="Release every task AGENT_ID holds: claimable again at once, not a "
        "failed attempt (POST /agents/release).",
    )
    p.add_argument("--agent-id", required=True, help="the agent whose tasks to release")
    p.add_argument("--reason", default="agent paused", help="recorded with each release")
    remote.add_client_options(p)
    p.set_defaults(func=pause_command)


def _json_arg(raw: str) -> Any:
    text = sys.stdin.read() if raw == "-" else raw
    return json.loads(text)


def _run_env() -> tuple[str, str, int | None, str]:
    try:
        run_id = os.environ["NULLTICKETS_RUN_ID"]
        token = os.environ["NULLTICKETS_LEASE_TOKEN"]
    except KeyError as exc:
        raise CommandFailed(
            f"{exc.args[0]} is not set: run this inside `nulltickets worker`"
        ) from None
    fence = os.environ.get("NULLTICKETS_FENCE")
    try:
        expected = int(fence) if fence else None
    except ValueError:
        raise CommandFailed(f"NULLTICKETS_FENCE must be an integer, got {fence!r}") from None
    base = os.environ.get(remote.ENV_BASE_URL) or remote.DEFAULT_BASE
    remote.check_base(base, remote.ENV_BASE_URL)
    return run_id, token, expected, base


def mcp_command(args: argparse.Namespace) -> int:
    if args.run:
        return _mcp_run(args)
    from nulltickets.mcp import stdio

    return stdio.main(args.base, args.key, args.agent_id, args.role)


def _mcp_run(args: argparse.Namespace) -> int:
    from nulltickets.mcp import run

    for flag, value in (("--role", args.role), ("--agent-id", args.agent_id)):
        if value is not None:
            raise CommandFailed(f"{flag} does not apply with --run: the worker claimed the task")
    try:
        directory, lease = run.bound_run()
    except channel.NotInRun as exc:
        raise CommandFailed(str(exc)) from None
    return run.main(directory, lease)


def checkpoint_command(args: argparse.Namespace) -> int:
    try:
        patch = _json_arg(args.patch)
    except ValueError as exc:
        raise CommandFailed(f"checkpoint must be JSON: {exc}") from None
    if not isinstance(patch, dict):
        raise CommandFailed("checkpoint must be a JSON object")
    run_id, token, fence, base = _run_env()
    with Client(base, os.environ.get(remote.ENV_TOKEN)) as api:
        try:
            result = api.checkpoint(run_id, token, patch, expected_fence=fence)
        except (ApiError, OSError) as exc:
            raise CommandFailed(f"checkpoint not written: {exc}") from None
    merged = bytes(result.checkpoint).decode()
    path = os.environ.get("NULLTICKETS_CHECKPOINT_FILE")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            f.write(merged)
    print(merged)
    return 0


def event_command(args: argparse.Namespace) -> int:
    try:
        data = _json_arg(args.data) if args.data is not None else None
    except ValueError as exc:
        raise CommandFailed(f"event data must be JSON: {exc}") from None
    run_id, token, fence, base = _run_env()
    with Client(base, os.environ.get(remote.ENV_TOKEN)) as api:
        try:
            event_id = api.event(run_id, token, args.kind, data, expected_fence=fence)
        except (ApiError, OSError) as exc:
            raise CommandFailed(f"event not written: {exc}") from None
    print(event_id)
    return 0


def _choose(choice: channel.Choice) -> None:
    try:
        channel.choose(choice)
    except channel.NotInRun as exc:
        raise CommandFailed(str(exc)) from None
    except OSError as exc:
        raise CommandFailed(f"outcome not recorded: {exc.strerror or exc}") from None


def transition_command(args: argparse.Namespace) -> int:
    trigger = args.trigger.strip()
    if not trigger:
        raise CommandFailed("the trigger must not be empty")
    try:
        directory = channel.run_dir()
    except channel.NotInRun as exc:
        raise CommandFailed(str(exc)) from None
    try:
        channel.check_trigger(directory, trigger)
    except channel.NotATransition as exc:
        raise CommandFailed(str(exc)) from None
    _choose(channel.Transition(trigger))
    return 0


def fail_command(args: argparse.Namespace) -> int:
    reason = sys.stdin.read() if args.reason == "-" else args.reason
    if not reason.strip():
        raise CommandFailed("the reason must not be empty")
    _choose(channel.Fail(reason[: channel.MAX_REASON]))
    return 0


def pause_command(args: argparse.Namespace) -> int:
    if not args.agent_id.strip():
        raise CommandFailed("--agent-id must not be empty")
    with remote.connect(args) as api:
        result = api.release_agent(args.agent_id, args.reason)
    print(
        json.dumps({"agent_id": result.agent_id, "released": [r.task_id for r in result.released]})
    )
    return 0
