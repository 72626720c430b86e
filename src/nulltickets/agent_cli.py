"""The agent-side commands: `worker`, and the helpers a running command (in any language) calls.

    nulltickets worker --role R [--base URL] [--token T] -- COMMAND [ARG...]
    nulltickets checkpoint '{"step": 2}'        merge into the task's checkpoint
    nulltickets event KIND ['{"any": "json"}']  append an event to the current run
    nulltickets pause --agent-id X              release whatever agent X holds (a Stop hook)

`checkpoint` and `event` read the run from the variables the worker sets (NULLTICKETS_RUN_ID,
NULLTICKETS_LEASE_TOKEN, NULLTICKETS_FENCE, NULLTICKETS_BASE_URL, NULLTICKETS_CHECKPOINT_FILE).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from nulltickets.client import ApiError, Client

AGENT_COMMANDS = ("worker", "checkpoint", "event", "pause")
DEFAULT_BASE = "http://127.0.0.1:7700"


def _fail(message: str) -> int:
    print(f"nulltickets: {message}", file=sys.stderr)
    return 1


def _json_arg(raw: str) -> Any:
    text = sys.stdin.read() if raw == "-" else raw
    return json.loads(text)


def _run_env() -> tuple[str, str, int | None, str]:
    try:
        run_id = os.environ["NULLTICKETS_RUN_ID"]
        token = os.environ["NULLTICKETS_LEASE_TOKEN"]
    except KeyError as exc:
        message = f"{exc.args[0]} is not set: run this inside `nulltickets worker`"
        raise SystemExit(_fail(message)) from None
    fence = os.environ.get("NULLTICKETS_FENCE")
    return (
        run_id,
        token,
        int(fence) if fence else None,
        os.environ.get("NULLTICKETS_BASE_URL", DEFAULT_BASE),
    )


def checkpoint_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(
        prog="nulltickets checkpoint", description="Merge a JSON object into the task's checkpoint."
    )
    p.add_argument("patch", help="a JSON object (RFC 7396 merge patch), or - for stdin")
    args = p.parse_args(argv)
    try:
        patch = _json_arg(args.patch)
    except ValueError as exc:
        return _fail(f"checkpoint must be JSON: {exc}")
    if not isinstance(patch, dict):
        return _fail("checkpoint must be a JSON object")
    run_id, token, fence, base = _run_env()
    with Client(base, os.environ.get("NULLTICKETS_TOKEN")) as api:
        try:
            result = api.checkpoint(run_id, token, patch, expected_fence=fence)
        except (ApiError, OSError) as exc:
            return _fail(f"checkpoint not written: {exc}")
    merged = bytes(result.checkpoint).decode()
    path = os.environ.get("NULLTICKETS_CHECKPOINT_FILE")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            f.write(merged)
    print(merged)
    return 0


def event_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(
        prog="nulltickets event", description="Append an event to the current run."
    )
    p.add_argument("kind")
    p.add_argument("data", nargs="?", default=None, help="JSON data, or - for stdin")
    args = p.parse_args(argv)
    try:
        data = _json_arg(args.data) if args.data is not None else None
    except ValueError as exc:
        return _fail(f"event data must be JSON: {exc}")
    run_id, token, fence, base = _run_env()
    with Client(base, os.environ.get("NULLTICKETS_TOKEN")) as api:
        try:
            event_id = api.event(run_id, token, args.kind, data, expected_fence=fence)
        except (ApiError, OSError) as exc:
            return _fail(f"event not written: {exc}")
    print(event_id)
    return 0


def pause_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(
        prog="nulltickets pause", description="Release every task an agent holds."
    )
    p.add_argument("--agent-id", required=True)
    p.add_argument("--base", default=os.environ.get("NULLTICKETS_BASE_URL", DEFAULT_BASE))
    p.add_argument("--token", default=os.environ.get("NULLTICKETS_TOKEN"))
    p.add_argument("--reason", default="agent paused")
    args = p.parse_args(argv)
    with Client(args.base, args.token) as api:
        try:
            result = api.release_agent(args.agent_id, args.reason)
        except (ApiError, OSError) as exc:
            return _fail(f"pause failed: {exc}")
    print(
        json.dumps({"agent_id": result.agent_id, "released": [r.task_id for r in result.released]})
    )
    return 0


def worker_main(argv: Sequence[str]) -> int:
    from nulltickets.worker import build_parser, main_from_args

    return main_from_args(build_parser().parse_args(list(argv)))


def main(argv: Sequence[str]) -> int:
    command, rest = argv[0], argv[1:]
    handlers = {
        "worker": worker_main,
        "checkpoint": checkpoint_main,
        "event": event_main,
        "pause": pause_main,
    }
    return handlers[command](rest)
