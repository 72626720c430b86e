"""The operator's commands against a running server: look at tasks, revive or cancel them,
follow a run, make and revoke keys.

    nulltickets tasks list [--state dead|cancelled|failing] [--stage S] [--pipeline P]
                           [--role R] [--limit N] [--json]
    nulltickets tasks show ID [--json]
    nulltickets tasks requeue ID [--stage S] [--reset-attempts] [--reason TEXT]
    nulltickets tasks cancel ID [--reason TEXT]
    nulltickets runs tail RUN_ID [--json]
    nulltickets keys create --name N --access read|agent|admin [--role R ...] [--json]
    nulltickets keys list [--json]
    nulltickets keys revoke ID

Each talks HTTP through nulltickets.client.Client (see remote.py for --base and --token).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from nulltickets.client import Client, remote
from nulltickets.client.remote import CommandFailed
from nulltickets.domain.model import (
    Access,
    CreatedKey,
    Event,
    FailedTask,
    KeyInfo,
    Task,
    TaskDetails,
    TaskEvent,
)

PAGE_MAX = 1000  # the server's largest page
# --state of `tasks list`: the kind of GET /ops/failures each names.
STATES = {"dead": "dead", "dead_lettered": "dead", "cancelled": "cancelled", "failing": "failing"}
LAST_EVENTS = 10  # what `tasks show` prints of the latest run
TAIL_POLL_S = 0.5
# The events that close a run: it completed (transition), failed or expired (retry_scheduled or
# dead_letter, after lease_expired), was put down (released) or its task cancelled.
RUN_ENDS = frozenset({"transition", "retry_scheduled", "dead_letter", "released", "cancelled"})


def register(commands: Any) -> None:
    tasks = commands.add_parser(
        "tasks",
        help="list, show, requeue or cancel tasks on a running server",
        description="Look at and act on the tasks of a running server.",
    )
    verbs = tasks.add_subparsers(dest="verb", metavar="{list,show,requeue,cancel}", required=True)

    p = verbs.add_parser(
        "list",
        help="tasks as a table (or JSON), oldest first; with --state, failed tasks newest first",
        description="List tasks, oldest first, following the server's pages up to --limit. "
        "With --state, list the dead-lettered, cancelled or failing tasks instead (GET "
        "/ops/failures): newest failure first, with the number of failed attempts and the "
        "last error.",
    )
    p.add_argument(
        "--state",
        choices=sorted(STATES),
        help="only tasks dead-lettered (wherever they landed), cancelled, or failing (failed "
        "since their last transition, retrying)",
    )
    p.add_argument("--stage", help="only tasks in this stage (e.g. dead)")
    p.add_argument("--pipeline", metavar="ID", help="only tasks of this pipeline")
    p.add_argument("--role", help="only tasks in a stage this agent role works on")
    p.add_argument("--limit", default="100", help="at most this many tasks (default 100)")
    p.add_argument("--json", action="store_true", help="a JSON array of tasks, for scripts")
    remote.add_client_options(p)
    p.set_defaults(func=tasks_list)

    p = verbs.add_parser(
        "show",
        help="one task: stage, runs, last events, checkpoint, failures",
        description="Show a task with its latest run, its last events, its checkpoint and "
        "the attempts that failed.",
    )
    p.add_argument("task_id", metavar="ID", help="the task's id")
    p.add_argument(
        "--json",
        action="store_true",
        help="one JSON object: task, last_events (its latest run's) and task_events",
    )
    remote.add_client_options(p)
    p.set_defaults(func=tasks_show)

    p = verbs.add_parser(
        "requeue",
        help="make a failed, dead-lettered or waiting task claimable now",
        description="Make the task claimable now, in --stage or in the stage it failed in "
        "(POST /tasks/{id}/requeue), and print it.",
    )
    p.add_argument("task_id", metavar="ID", help="the task's id")
    p.add_argument("--stage", help="the stage to requeue into (must not be terminal)")
    p.add_argument(
        "--reset-attempts", action="store_true", help="count failed attempts from zero again"
    )
    p.add_argument("--reason", metavar="TEXT", help="why, recorded as an event")
    p.add_argument("--json", action="store_true", help="print the task as JSON")
    remote.add_client_options(p)
    p.set_defaults(func=tasks_requeue)

    p = verbs.add_parser(
        "cancel",
        help="never claim the task again (a live lease is revoked)",
        description="Cancel the task (POST /tasks/{id}/cancel): it is never claimed again and "
        "a live lease is revoked at once. Prints the task.",
    )
    p.add_argument("task_id", metavar="ID", help="the task's id")
    p.add_argument("--reason", metavar="TEXT", help="why, recorded as an event")
    p.add_argument("--json", action="store_true", help="print the task as JSON")
    remote.add_client_options(p)
    p.set_defaults(func=tasks_cancel)

    runs = commands.add_parser(
        "runs",
        help="follow a run's events",
        description="Look at runs on a running server.",
    )
    verbs = runs.add_subparsers(dest="verb", metavar="{tail}", required=True)
    p = verbs.add_parser(
        "tail",
        help="print a run's events as they come, until the run ends",
        description="Print the run's events, then each new one as it comes; exit 0 when the "
        f"run ends (an event {', '.join(sorted(RUN_ENDS))}) and 130 on Ctrl-C.",
    )
    p.add_argument("run_id", metavar="RUN_ID", help="the run's id")
    p.add_argument("--json", action="store_true", help="one JSON object per event")
    remote.add_client_options(p)
    p.set_defaults(func=runs_tail)

    keys = commands.add_parser(
        "keys",
        help="make, list or revoke the keys of a running server",
        description="Keys beside the server's --token: read (sees everything, changes "
        "nothing), agent (claims for its roles and makes the writes agents make) or admin. "
        "These commands need the --token (or an admin key).",
    )
    verbs = keys.add_subparsers(dest="verb", metavar="{create,list,revoke}", required=True)
    p = verbs.add_parser(
        "create",
        help="make a key and print it (the only time it is shown)",
        description="Make a key (POST /keys) and print it on stdout, alone on its line: the "
        "server keeps only its hash, so this is the only time it is shown.",
    )
    p.add_argument("--name", required=True, help="what the key is for (e.g. the agent's host)")
    p.add_argument(
        "--access",
        required=True,
        choices=[a.value for a in Access],
        help="read, agent or admin",
    )
    p.add_argument(
        "--role",
        action="append",
        default=[],
        metavar="R",
        help="an agent role the key may claim for (agent keys; repeat for more)",
    )
    p.add_argument("--json", action="store_true", help="print the whole answer as JSON")
    remote.add_client_options(p)
    p.set_defaults(func=keys_create)

    p = verbs.add_parser(
        "list",
        help="every key: id, name, access, roles (never the key itself)",
        description="List the keys (GET /keys): never the key itself.",
    )
    p.add_argument("--json", action="store_true", help="a JSON array of keys, for scripts")
    remote.add_client_options(p)
    p.set_defaults(func=keys_list)

    p = verbs.add_parser(
        "revoke",
        help="revoke a key: refused at once, on every server",
        description="Revoke a key (DELETE /keys/{id}): every server refuses it from now on.",
    )
    p.add_argument("key_id", metavar="ID", help="the key's id (see keys list)")
    remote.add_client_options(p)
    p.set_defaults(func=keys_revoke)


# --- fetching ----------------------------------------------------------------------------------


def fetch_tasks(
    api: Client,
    *,
    stage: str | None = None,
    pipeline_id: str | None = None,
    role: str | None = None,
    limit: int,
) -> list[Task]:
    items: list[Task] = []
    cursor: str | None = None
    while len(items) < limit:
        size = min(PAGE_MAX, limit - len(items))
        page = api.list_tasks(
            stage=stage, pipeline_id=pipeline_id, role=role, limit=size, cursor=cursor
        )
        items.extend(page.items)
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    return items[:limit]


def fetch_failures(
    api: Client, *, kind: str, pipeline_id: str | None = None, limit: int
) -> list[FailedTask]:
    """Failed tasks of one kind, newest first, following the server's pages up to `limit`."""
    items: list[FailedTask] = []
    cursor: str | None = None
    while len(items) < limit:
        size = min(PAGE_MAX, limit - len(items))
        page = api.list_failures(kind=kind, pipeline_id=pipeline_id, limit=size, cursor=cursor)
        items.extend(page.items)
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    return items[:limit]


def fetch_events(api: Client, run_id: str, after: int = 0) -> list[Event]:
    """Every event of the run after event id `after`, oldest first. The one place `runs tail`
    gets events from (so it can switch to a stream without touching the rest)."""
    items: list[Event] = []
    while True:
        page = api.list_events(run_id, cursor=str(after), limit=PAGE_MAX)
        items.extend(page.items)
        if page.next_cursor is None or not page.items:
            return items
        after = page.items[-1].id


def fetch_task_events(api: Client, task_id: str) -> list[TaskEvent]:
    """What operators did to the task (requeued, cancelled), oldest first."""
    items: list[TaskEvent] = []
    after = 0
    while True:
        page = api.list_task_events(task_id, cursor=str(after), limit=PAGE_MAX)
        items.extend(page.items)
        if page.next_cursor is None or not page.items:
            return items
        after = page.items[-1].id


# --- printing ----------------------------------------------------------------------------------


def when(ms: int | None) -> str:
    if ms is None:
        return "-"
    seconds, millis = divmod(ms, 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"


def _raw(value: msgspec.Raw) -> str:
    return bytes(value).decode()


def to_json(value: Any) -> str:
    return msgspec.json.encode(value).decode()


def task_state(task: Task, now: int) -> str:
    """What a task's own row says of it: dead_lettered, cancelled (a cancel parks a task
    under the reason "cancelled"), waiting_retry (a failed attempt's retry delay runs), or
    "-"."""
    if task.dead_letter_reason == "cancelled":
        return "cancelled"
    if task.dead_letter_reason is not None:
        return "dead_lettered"
    if task.next_eligible_at_ms > now:
        return "waiting_retry"
    return "-"


def task_table(tasks: list[Task]) -> str:
    now = int(time.time() * 1000)
    header = ("ID", "STAGE", "STATE", "PRIORITY", "UPDATED", "TITLE")
    rows = [
        (
            t.id,
            t.stage,
            task_state(t, now),
            str(t.priority),
            when(t.updated_at_ms),
            _shorten(t.title, 60),
        )
        for t in tasks
    ]
    return _table(header, rows)


def failure_table(items: list[FailedTask]) -> str:
    header = ("ID", "STAGE", "STATE", "FAILURES", "AT", "ERROR", "TITLE")
    rows = [
        (
            f.id,
            f.stage,
            f.state,
            str(f.failures),
            when(f.at_ms),
            _shorten(f.last_error or "-", 40),
            _shorten(f.title, 60),
        )
        for f in items
    ]
    return _table(header, rows)


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> str:
    """Columns padded to their widest cell; the last one (free text) as it is."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    lines = []
    for row in [header, *rows]:
        cells = [cell.ljust(widths[i]) for i, cell in enumerate(row[:-1])]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    return "\n".join(lines)


def _shorten(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def event_line(event: Event) -> str:
    return f"{when(event.ts_ms)}  {event.kind}  {_raw(event.data)}"


def task_text(
    task: TaskDetails,
    events: list[Event] | None = None,
    task_events: list[TaskEvent] | None = None,
) -> str:
    lines = [
        f"task        {task.id}",
        f"title       {task.title}",
        f"pipeline    {task.pipeline_id}",
        f"stage       {task.stage} (version {task.task_version}, priority {task.priority})",
    ]
    cancelled_at = task.cancelled_at_ms if isinstance(task.cancelled_at_ms, int) else None
    cancelled = cancelled_at is not None
    # A dead-lettered or cancelled task is parked at a time far beyond any date (the
    # original's value): it is claimable again only once requeued, which the lines below say.
    if task.dead_letter_reason is None and task.next_eligible_at_ms > int(time.time() * 1000):
        lines.append(f"eligible    from {when(task.next_eligible_at_ms)}")
    if task.dead_letter_reason and not (cancelled and task.dead_letter_reason == "cancelled"):
        lines.append(f"dead letter {task.dead_letter_reason} (claimable again once requeued)")
    if cancelled:
        reason = task.cancel_reason if isinstance(task.cancel_reason, str) else "-"
        lines.append(f"cancelled   {when(cancelled_at)}: {reason}")
    attempts = "unlimited" if task.max_attempts is None else str(task.max_attempts)
    lines.append(f"attempts    {len(task.previous_failures)} failed, max {attempts}")
    run = task.latest_run
    if isinstance(run, msgspec.UnsetType):
        lines.append("latest run  none")
    else:
        agent = f"{run.agent_id} ({run.agent_role})" if run.agent_id else "-"
        lines.append(
            f"latest run  {run.id} attempt {run.attempt} {run.status}, agent {agent}, "
            f"started {when(run.started_at_ms)}, ended {when(run.ended_at_ms)}"
        )
    if task.available_transitions:
        moves = ", ".join(f"{t.trigger} -> {t.to}" for t in task.available_transitions)
        lines.append(f"transitions {moves}")
    lines.append(f"checkpoint  {_raw(task.checkpoint)}")
    if task.previous_failures:
        lines.append("failures")
        for f in task.previous_failures:
            lines.append(
                f"  attempt {f.attempt}  {f.status}  {when(f.ended_at_ms)}  run {f.run_id}  "
                f"{_shorten(f.error or '-', 200)}"
            )
    if events is not None:
        lines.append("last events" if events else "last events none")
        lines.extend(f"  {event_line(e)}" for e in events)
    if task_events:
        lines.append("task events")
        lines.extend(f"  {when(e.ts_ms)}  {e.kind}  {_raw(e.data)}" for e in task_events)
    return "\n".join(lines)


# --- commands ----------------------------------------------------------------------------------


def _limit(raw: str) -> int:
    text = raw.strip()
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise CommandFailed(f"--limit must be a positive integer, got {raw!r}")
    return int(text)


def tasks_list(args: argparse.Namespace) -> int:
    limit = _limit(args.limit)
    if args.state is not None:
        return _failed_tasks_list(args, STATES[args.state], limit)
    with remote.connect(args) as api:
        tasks = fetch_tasks(
            api, stage=args.stage, pipeline_id=args.pipeline, role=args.role, limit=limit
        )
    print(to_json(tasks) if args.json else task_table(tasks))
    return 0


def _failed_tasks_list(args: argparse.Namespace, kind: str, limit: int) -> int:
    if args.stage is not None or args.role is not None:
        raise CommandFailed("--state lists failed tasks by pipeline only: leave out --stage/--role")
    with remote.connect(args) as api:
        items = fetch_failures(api, kind=kind, pipeline_id=args.pipeline, limit=limit)
    print(to_json(items) if args.json else failure_table(items))
    return 0


def tasks_show(args: argparse.Namespace) -> int:
    with remote.connect(args) as api:
        task = api.get_task(args.task_id)
        events: list[Event] = []
        if not isinstance(task.latest_run, msgspec.UnsetType):
            events = fetch_events(api, task.latest_run.id)[-LAST_EVENTS:]
        task_events = fetch_task_events(api, args.task_id)[-LAST_EVENTS:]
    if args.json:
        print(to_json({"task": task, "last_events": events, "task_events": task_events}))
    else:
        print(task_text(task, events, task_events))
    return 0


def _show(args: argparse.Namespace, task: TaskDetails) -> int:
    """Print the task a verb answered with (as GET /tasks/{id} shows it)."""
    print(to_json(task) if args.json else task_text(task))
    return 0


def tasks_requeue(args: argparse.Namespace) -> int:
    with remote.connect(args) as api:
        task = api.requeue(
            args.task_id, args.stage, reset_attempts=args.reset_attempts, reason=args.reason
        )
    return _show(args, task)


def tasks_cancel(args: argparse.Namespace) -> int:
    with remote.connect(args) as api:
        task = api.cancel(args.task_id, args.reason)
    return _show(args, task)


def runs_tail(args: argparse.Namespace) -> int:
    try:
        with remote.connect(args) as api:
            after = 0
            while True:
                for event in fetch_events(api, args.run_id, after):
                    try:
                        print(to_json(event) if args.json else event_line(event), flush=True)
                    except BrokenPipeError:  # `runs tail X | head`: the reader has enough
                        return 0
                    after = event.id
                    if event.kind in RUN_ENDS:
                        return 0
                time.sleep(TAIL_POLL_S)
    except KeyboardInterrupt:
        sys.stderr.write("\n")
        return 130


# --- keys ----------------------------------------------------------------------------------------


def _key_summary(key: KeyInfo | CreatedKey) -> str:
    roles = f", roles {', '.join(key.roles)}" if key.roles else ""
    return f"{key.id} ({key.name}: {key.access}{roles})"


def key_table(keys: list[KeyInfo]) -> str:
    header = ("ID", "ACCESS", "CREATED", "ROLES", "NAME")
    rows = [
        (k.id, k.access.value, when(k.created_at_ms), ",".join(k.roles) or "-", k.name)
        for k in keys
    ]
    return _table(header, rows)


def keys_create(args: argparse.Namespace) -> int:
    with remote.connect(args) as api:
        made = api.create_key(args.name, args.access, args.role or None)
    if args.json:
        print(to_json(made))
    else:
        print(made.key, flush=True)
    print(
        f"nulltickets: made key {_key_summary(made)}. This is the only time the key is shown: "
        "the server keeps only its hash.",
        file=sys.stderr,
    )
    return 0


def keys_list(args: argparse.Namespace) -> int:
    with remote.connect(args) as api:
        keys = api.list_keys()
    print(to_json(keys) if args.json else key_table(keys))
    return 0


def keys_revoke(args: argparse.Namespace) -> int:
    with remote.connect(args) as api:
        gone = api.revoke_key(args.key_id)
    print(f"revoked key {_key_summary(gone)}")
    return 0
