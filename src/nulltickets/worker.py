"""`nulltickets worker`: run any command as an agent, one claimed task at a time.

For each task it claims (long-polling while there is none) the worker runs COMMAND with the
task as JSON on stdin and these variables set:

    NULLTICKETS_BASE_URL, NULLTICKETS_TOKEN   where the server is (the token only if given)
    NULLTICKETS_TASK_ID, NULLTICKETS_RUN_ID, NULLTICKETS_LEASE_ID, NULLTICKETS_LEASE_TOKEN
    NULLTICKETS_FENCE, NULLTICKETS_ATTEMPT, NULLTICKETS_STAGE
    NULLTICKETS_CHECKPOINT_FILE   the task's checkpoint as JSON ({} the first time); the
                                  `nulltickets checkpoint` command merges into it and the task
    NULLTICKETS_TASK_FILE         the claimed task as JSON (what stdin carried)

While the command runs, the worker heartbeats its lease. Exit status 0 moves the task along the
trigger the command printed (a line `nulltickets:trigger=NAME` on stdout), else `--trigger`,
else the stage's only transition. Any other exit fails the attempt with the tail of stderr, so
the retry policy decides what happens next. SIGTERM or SIGINT stops the command and releases
the task (not a failed attempt). On Linux a SIGKILL of the worker takes the command with it
(it gets SIGTERM from the kernel).

The worker outlives the server: a claim, heartbeat or outcome that cannot reach it is tried
again (with capped exponential backoff and jitter) until the server answers, and every write
carries an Idempotency-Key, so one repeated after a lost answer is replayed, not applied twice.
Only a definitive answer ends a lease: expired, superseded by a newer claim, or the task
cancelled; the command is then stopped and the worker moves on to the next task.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import msgspec

from nulltickets.client import (
    DEFAULT_BASE_URL,
    FOREVER,
    ApiError,
    Client,
    ClientAborted,
    Retry,
    RetryEvent,
)
from nulltickets.domain.model import ClaimResult
from nulltickets.lifetime import end_with_this_process

TRIGGER_PREFIX = "nulltickets:trigger="
STDERR_TAIL = 4000  # bytes of stderr sent with a failed attempt
CONSOLE_LINES = 5  # lines of stderr the console shows for a failed attempt
STOP_GRACE_S = 10.0  # between SIGTERM and SIGKILL of a command that must stop
SETTLE_ON_STOP_S = 5.0  # how long a stopping worker still tries to record an outcome

# Status of `--once`; a plain worker exits 0 when it is stopped or has done its --max-tasks.
EXIT_OK = 0  # --once: the task moved along a transition
EXIT_FAILED = 1  # --once: the attempt failed, was refused or lost; or a fatal refusal
EXIT_USAGE = 2  # bad flags, or the command cannot be found
EXIT_IDLE = 3  # --once --exit-when-idle: there was nothing to claim


class Outcome(Enum):
    MOVED = "moved"  # the command succeeded and the task moved on
    FAILED = "failed"  # the attempt failed (or its outcome was refused)
    LOST = "lost"  # the lease was lost for good; the task is someone else's now
    RELEASED = "released"  # the worker was stopped; the task was put down
    UNRECORDED = "unrecorded"  # the worker stopped before the server heard the outcome


@dataclass
class WorkerOptions:
    role: str
    command: list[str]
    base_url: str = DEFAULT_BASE_URL
    token: str | None = None
    agent_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    trigger: str | None = None
    lease_ttl_ms: int | None = None
    wait_ms: int = 30_000
    max_tasks: int | None = None  # stop after this many tasks
    once: bool = False  # one task, then exit with its outcome
    exit_when_idle: bool = False  # stop at the first empty claim
    retry: Retry = FOREVER


class Fatal(Exception):
    """The server refused the worker itself (a bad token, a bad flag): retrying cannot help."""


class Worker:
    def __init__(self, options: WorkerOptions) -> None:
        self.options = options
        self.stopping = threading.Event()
        self.api = self._client()
        self.child: subprocess.Popen[bytes] | None = None
        self.settling = False
        self.done = 0
        self.outcomes: list[Outcome] = []

    def _client(self) -> Client:
        def on_retry(event: RetryEvent) -> None:
            n = event.attempt
            if n & (n - 1) == 0:  # the 1st, 2nd, 4th, 8th... failure of a call: not a flood
                self.log(
                    f"{event.method} {event.path}: {event.reason}; retrying in "
                    f"{event.delay:.1f} s (attempt {n + 1})"
                )

        opts = self.options
        return Client(opts.base_url, opts.token, retry=opts.retry, on_retry=on_retry)

    def log(self, message: str) -> None:
        print(f"nulltickets worker {self.options.agent_id}: {message}", file=sys.stderr, flush=True)

    def stop(self, signum: int = signal.SIGTERM, frame: object = None) -> None:
        """Ask the worker to stop: the command gets SIGTERM, the task is released."""
        self.stopping.set()
        child = self.child
        if child is not None and child.poll() is None:
            _terminate(child)
        elif self.settling:  # let the outcome be recorded, for a while
            timer = threading.Timer(SETTLE_ON_STOP_S, self.api.abort)
            timer.daemon = True
            timer.start()
        else:
            self.api.abort()  # leave a long-polling claim now; the server claims nothing

    # --- the loop ------------------------------------------------------------------------------

    def run(self) -> int:
        opts = self.options
        try:
            while not self.stopping.is_set():
                if opts.max_tasks is not None and self.done >= opts.max_tasks:
                    break
                try:
                    claimed = self.api.claim(
                        opts.agent_id,
                        opts.role,
                        lease_ttl_ms=opts.lease_ttl_ms,
                        wait_ms=opts.wait_ms,
                    )
                except ClientAborted:
                    break
                except OSError as exc:  # only with a bounded retry policy
                    self.log(f"claim failed: {exc}; trying again")
                    self.stopping.wait(1.0)
                    continue
                except ApiError as exc:
                    raise Fatal(f"the server refused to give out work: {exc}") from exc
                if claimed is None:
                    if opts.exit_when_idle:
                        if opts.once:
                            self.log("nothing to claim")
                            return EXIT_IDLE
                        break
                    continue
                self.outcomes.append(self.work(claimed))
                self.done += 1
                if opts.once:
                    break
        except Fatal as exc:
            self.log(str(exc))
            return EXIT_FAILED
        finally:
            self.api.close()
        if opts.once:
            return EXIT_OK if self.outcomes == [Outcome.MOVED] else EXIT_FAILED
        return EXIT_OK

    def work(self, claimed: ClaimResult) -> Outcome:
        opts = self.options
        task, run = claimed.task, claimed.run
        with tempfile.TemporaryDirectory(prefix="nulltickets-run-") as tmp:
            task_json = json.dumps(json.loads(msgspec.json.encode(task)), indent=2)
            task_file = Path(tmp, "task.json")
            task_file.write_text(task_json)
            checkpoint = json.loads(bytes(task.checkpoint)) or {}
            checkpoint_file = Path(tmp, "checkpoint.json")
            checkpoint_file.write_text(json.dumps(checkpoint))
            env = {
                **os.environ,
                "NULLTICKETS_BASE_URL": opts.base_url,
                "NULLTICKETS_TASK_ID": task.id,
                "NULLTICKETS_RUN_ID": run.id,
                "NULLTICKETS_LEASE_ID": claimed.lease_id,
                "NULLTICKETS_LEASE_TOKEN": claimed.lease_token,
                "NULLTICKETS_FENCE": str(claimed.fence),
                "NULLTICKETS_ATTEMPT": str(run.attempt),
                "NULLTICKETS_STAGE": task.stage,
                "NULLTICKETS_CHECKPOINT_FILE": str(checkpoint_file),
                "NULLTICKETS_TASK_FILE": str(task_file),
            }
            if opts.token is not None:
                env["NULLTICKETS_TOKEN"] = opts.token
            if self.stopping.is_set():  # stopped between the claim and the start
                return self._release(claimed, "worker stopped")
            self.log(f"task {task.id} attempt {run.attempt} (fence {claimed.fence})")
            # A claim repeated after a lost answer may hand back a lease that has expired
            # meanwhile: make sure it is still ours before any work is done under it.
            try:
                self.api.heartbeat(
                    claimed.lease_id, claimed.lease_token, expected_fence=claimed.fence
                )
            except ApiError as exc:
                if exc.lease_lost:
                    self.log(f"task {task.id}: lease already lost ({exc}); skipped")
                    return Outcome.LOST
                raise Fatal(f"heartbeat refused: {exc}") from exc
            except ClientAborted:
                return self._release(claimed, "worker stopped")
            try:
                self.child = subprocess.Popen(
                    opts.command,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env=env,
                    # A SIGKILLed worker takes its command with it: an orphan would go on
                    # with a task whose lease then expires and is claimed again.
                    preexec_fn=end_with_this_process(),
                )
            except OSError as exc:
                message = f"cannot start command {opts.command[0]!r}: {exc}"
                return self._settle(claimed, 127, message, None)
            beat = _Heartbeat(self, claimed)
            beat.start()
            printed: list[str] = []
            tail: deque[bytes] = deque()
            pumps = [
                threading.Thread(target=_pump_stdout, args=(self.child, printed), daemon=True),
                threading.Thread(target=_pump_stderr, args=(self.child, tail), daemon=True),
            ]
            for p in pumps:
                p.start()
            assert self.child.stdin is not None
            try:
                self.child.stdin.write(task_json.encode())
                self.child.stdin.close()
            except BrokenPipeError:
                pass
            code = self.child.wait()
            for p in pumps:
                p.join(5)
            self.child = None
            beat.finish()
            stderr = b"".join(tail).decode("utf-8", "replace")[-STDERR_TAIL:]
            if beat.lost is not None:
                self.log(f"task {task.id}: lease lost ({beat.lost}); command stopped")
                return Outcome.LOST
            if self.stopping.is_set():
                self.api = self._client()  # the old one may be aborted
                return self._release(claimed, "worker stopped")
            return self._settle(claimed, code, stderr, printed[-1] if printed else None)

    # --- recording the outcome -----------------------------------------------------------------

    def _settle(
        self, claimed: ClaimResult, exit_code: int, stderr: str, printed_trigger: str | None
    ) -> Outcome:
        """Transition or fail the run, retrying until the server says yes or no for good."""
        task_id, run, fence = claimed.task.id, claimed.run, claimed.fence
        token = claimed.lease_token
        self.settling = True
        try:
            if exit_code == 0:
                trigger = printed_trigger or self.options.trigger or _only_trigger(claimed)
                if trigger is None:
                    error = (
                        "command succeeded but no trigger was given or printed and the stage "
                        "has several transitions"
                    )
                    return self._fail(claimed, error)
                try:
                    moved = self.api.transition(run.id, token, trigger, expected_fence=fence)
                except ApiError as exc:
                    if exc.lease_lost:
                        self.log(f"task {task_id}: transition refused, lease lost ({exc})")
                        return Outcome.LOST
                    # A trigger the stage does not have, say: fail now, not at lease expiry.
                    self.log(f"task {task_id}: transition {trigger!r} refused ({exc})")
                    return self._fail(claimed, f"transition {trigger!r} refused: {exc}")
                self.log(f"task {task_id}: {moved.previous_stage} -> {moved.new_stage}")
                return Outcome.MOVED
            why = _exit_reason(exit_code)
            lines = stderr.rstrip().splitlines()[-CONSOLE_LINES:]
            shown = "".join(f"\n    | {line}" for line in lines)
            self.log(f"task {task_id} attempt {run.attempt} failed: {why}{shown}")
            return self._fail(claimed, f"{why}\n{stderr}".strip())
        except ClientAborted:
            self.log(f"task {task_id}: stopped before the outcome was recorded; lease will expire")
            return Outcome.UNRECORDED
        finally:
            self.settling = False

    def _fail(self, claimed: ClaimResult, error: str) -> Outcome:
        try:
            self.api.fail(claimed.run.id, claimed.lease_token, error, expected_fence=claimed.fence)
        except ApiError as exc:
            self.log(f"task {claimed.task.id}: failure not recorded ({exc})")
        return Outcome.FAILED

    def _release(self, claimed: ClaimResult, reason: str) -> Outcome:
        opts = self.options
        # A stopping worker tries for a few seconds only: the lease expires otherwise.
        with Client(opts.base_url, opts.token, retry=Retry(timeout=SETTLE_ON_STOP_S)) as api:
            try:
                api.release(
                    claimed.run.id, claimed.lease_token, reason, expected_fence=claimed.fence
                )
                self.log(f"task {claimed.task.id}: released")
            except (ApiError, OSError) as exc:
                self.log(f"task {claimed.task.id}: could not release: {exc}")
        return Outcome.RELEASED


class _Heartbeat:
    """Extends the lease every third of its TTL while the command runs. A heartbeat that
    cannot reach the server is retried (the command keeps running); a definitive refusal
    (expired, superseded, cancelled) stops the command."""

    def __init__(self, worker: Worker, claimed: ClaimResult) -> None:
        self.worker, self.claimed = worker, claimed
        started = claimed.run.started_at_ms or claimed.expires_at_ms
        self.ttl_s = max(0.3, (claimed.expires_at_ms - started) / 1000)
        self.lost: ApiError | None = None
        self.done = threading.Event()
        opts = worker.options
        # A hung server must not hold a heartbeat past the lease: give up an attempt early.
        self.api = Client(
            opts.base_url,
            opts.token,
            timeout=max(1.0, self.ttl_s / 3),
            retry=FOREVER,
            on_retry=self._retrying,
        )
        self.thread = threading.Thread(target=self._beat, daemon=True)
        self.failures = 0

    def start(self) -> None:
        self.thread.start()

    def finish(self) -> None:
        self.done.set()
        self.api.abort()
        self.thread.join(5)
        self.api.close()

    def _retrying(self, event: RetryEvent) -> None:
        self.failures += 1
        if event.attempt & (event.attempt - 1) == 0:
            self.worker.log(f"task {self.claimed.task.id}: heartbeat: {event.reason}; retrying")

    def _beat(self) -> None:
        c = self.claimed
        while not self.done.wait(self.ttl_s / 3):
            try:
                self.api.heartbeat(c.lease_id, c.lease_token, expected_fence=c.fence)
            except ClientAborted:
                return
            except ApiError as exc:
                if not exc.lease_lost:
                    self.worker.log(f"task {c.task.id}: heartbeat refused ({exc})")
                    continue
                self.lost = exc
                child = self.worker.child
                if child is not None and child.poll() is None:
                    _terminate(child)
                return
            if self.failures:
                self.worker.log(f"task {c.task.id}: heartbeat reached the server again")
                self.failures = 0


def _terminate(child: subprocess.Popen[bytes]) -> None:
    """SIGTERM now, SIGKILL if the command is still running after STOP_GRACE_S."""
    child.send_signal(signal.SIGTERM)

    def kill() -> None:
        if child.poll() is None:
            child.kill()

    timer = threading.Timer(STOP_GRACE_S, kill)
    timer.daemon = True
    timer.start()


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "an unknown signal"
        return f"command was killed by signal {-code} ({name})"
    if code == 127:
        return "command could not be started (status 127)"
    return f"command exited with status {code}"


def _only_trigger(claimed: ClaimResult) -> str | None:
    triggers = {t.trigger for t in claimed.task.available_transitions}
    return triggers.pop() if len(triggers) == 1 else None


def _pump_stdout(child: subprocess.Popen[bytes], printed: list[str]) -> None:
    assert child.stdout is not None
    for raw in child.stdout:
        line = raw.decode("utf-8", "replace")
        sys.stdout.write(line)
        sys.stdout.flush()
        stripped = line.strip()
        if stripped.startswith(TRIGGER_PREFIX):
            printed.append(stripped[len(TRIGGER_PREFIX) :])
    sys.stdout.flush()


def _pump_stderr(child: subprocess.Popen[bytes], tail: deque[bytes]) -> None:
    assert child.stderr is not None
    kept = 0
    for raw in child.stderr:
        sys.stderr.buffer.write(raw)
        sys.stderr.buffer.flush()  # a log being followed shows each line as the command writes it
        tail.append(raw)
        kept += len(raw)
        while kept > STDERR_TAIL * 2 and len(tail) > 1:
            kept -= len(tail.popleft())
    sys.stderr.flush()


def run_worker(options: WorkerOptions) -> int:
    worker = Worker(options)
    signal.signal(signal.SIGTERM, worker.stop)
    signal.signal(signal.SIGINT, worker.stop)
    worker.log(f"claiming tasks for role {options.role!r} from {options.base_url}")
    started = time.monotonic()
    code = worker.run()
    worker.log(f"stopped after {worker.done} task(s) in {time.monotonic() - started:.1f} s")
    return code


# --- the command line --------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `nulltickets worker`; `main_from_args` runs what they parse to."""
    env = os.environ.get
    parser.add_argument("--role", required=True, help="claim tasks whose stage is for this role")
    parser.add_argument(
        "--base",
        default=env("NULLTICKETS_BASE_URL", DEFAULT_BASE_URL),
        help="the server's URL, http:// or https:// "
        "(default: $NULLTICKETS_BASE_URL, else %(default)s)",
    )
    parser.add_argument(
        "--token",
        default=env("NULLTICKETS_TOKEN"),
        help="the server's admin token, if it has one (default: $NULLTICKETS_TOKEN)",
    )
    parser.add_argument(
        "--agent-id", default=None, help="the agent id claims are made as (default: HOST-PID)"
    )
    parser.add_argument(
        "--trigger",
        default=None,
        help="the trigger to move a task along when the command exits 0 and printed none "
        "(default: the stage's only transition)",
    )
    parser.add_argument(
        "--lease-ttl-ms",
        type=int,
        default=None,
        help="lease TTL asked for each claim (default: the stage's or the server's)",
    )
    parser.add_argument(
        "--wait-ms",
        type=int,
        default=30_000,
        help="how long each claim waits for work before asking again (default: %(default)s)",
    )
    parser.add_argument(
        "--max-tasks", type=int, default=None, help="exit (status 0) after this many tasks"
    )
    parser.add_argument(
        "--once",
        action="store_true",
        help="claim one task (waiting for it), run the command, record the outcome, exit: "
        "status 0 when the task moved on, 1 when the attempt failed, was refused or its "
        "lease was lost, or the worker was stopped first",
    )
    parser.add_argument(
        "--exit-when-idle",
        action="store_true",
        help="exit at the first claim that finds nothing (status 0; with --once, 3)",
    )
    parser.add_argument(
        "worker_command",  # not `command`: a CLI's subparsers often use that dest
        nargs="*",
        metavar="COMMAND",
        help="the command to run for each task, after --: the task arrives as JSON on stdin",
    )


def main_from_args(args: argparse.Namespace) -> int:
    """Run a worker from the flags `add_arguments` defined; its exit status."""
    command: list[str] = list(args.worker_command)
    if not command:
        return _usage("give the command after --, e.g. worker --role coder -- ./agent.sh")
    for name, value in (("--wait-ms", args.wait_ms), ("--max-tasks", args.max_tasks)):
        if value is not None and value < 0:
            return _usage(f"{name} must not be negative")
    if args.lease_ttl_ms is not None and args.lease_ttl_ms <= 0:
        return _usage("--lease-ttl-ms must be positive")
    try:
        Client(args.base).close()
    except ValueError as exc:
        return _usage(f"--base: {exc}")
    program = command[0]
    if shutil.which(program) is None:
        return _usage(f"command not found: {program}")
    options = WorkerOptions(
        role=args.role,
        command=command,
        base_url=args.base,
        token=args.token,
        trigger=args.trigger,
        lease_ttl_ms=args.lease_ttl_ms,
        wait_ms=args.wait_ms,
        max_tasks=args.max_tasks,
        once=args.once,
        exit_when_idle=args.exit_when_idle,
    )
    if args.agent_id:
        options.agent_id = args.agent_id
    return run_worker(options)


def _usage(message: str) -> int:
    print(f"nulltickets worker: {message}", file=sys.stderr)
    return EXIT_USAGE


def build_parser(
    factory: Callable[..., argparse.ArgumentParser] = argparse.ArgumentParser,
) -> argparse.ArgumentParser:
    parser = factory(
        prog="nulltickets worker",
        description="Run COMMAND for each task claimed for a role, heartbeating its lease and "
        "recording the outcome; survives server restarts.",
    )
    add_arguments(parser)
    return parser
