"""`nulltickets worker`: run any command as an agent, one claimed task at a time.

For each task it claims (long-polling while there is none) the worker runs COMMAND with the
task as JSON on stdin, in a session (and process group) of its own, with the environment it
runs in minus every NULLTICKETS_* variable of the worker's own and every variable that holds
the worker's token, plus its run:

    NULLTICKETS_BASE_URL          where the server is
    NULLTICKETS_TASK_ID, NULLTICKETS_RUN_ID, NULLTICKETS_LEASE_ID, NULLTICKETS_LEASE_TOKEN
    NULLTICKETS_FENCE, NULLTICKETS_ATTEMPT, NULLTICKETS_STAGE
    NULLTICKETS_RUN_DIR           the run's private directory (mode 0700): the channel back
    NULLTICKETS_CHECKPOINT_FILE   the task's checkpoint as JSON ({} the first time); the
                                  `nulltickets checkpoint` command merges into it and the task
    NULLTICKETS_TASK_FILE         the claimed task as JSON (what stdin carried)
    NULLTICKETS_MCP_CONFIG        an MCP configuration ({"mcpServers": {"nulltickets": ...}})
                                  that starts `nulltickets mcp --run`: the tools bound to this
                                  run, for an agent the command starts (claude --mcp-config)

The command never gets the admin token or the worker's key: the lease token of its own run is
all `nulltickets checkpoint` and `nulltickets event` need.

While the command runs, the worker heartbeats its lease. The command chooses its outcome on
purpose, never by what it prints (stdout and stderr are logs): `nulltickets transition TRIGGER`
or `nulltickets fail REASON`, run from inside it, or the tools transition_task and fail_task of
`nulltickets mcp --run` called by an agent it started, record a choice in the run's directory
(worker/channel.py), acted on once the command has exited. Exit status 0 moves the task along
the chosen transition, else `--trigger`, else the stage's only transition; `nulltickets fail` fails
the attempt with its reason whatever the status; any other exit fails the attempt with the
tail of stderr, so the retry policy decides what happens next.

The command's whole group (the command and everything it started) is ended (SIGTERM, SIGKILL
one second later) when the command exits (what it left running), when the worker is stopped
(SIGTERM or SIGINT: the task is then released, not a failed attempt, and the worker exits
within two seconds), when the lease is lost or the task cancelled (noticed at the next
heartbeat), when no heartbeat has reached the server for a whole lease TTL (the lease has
expired there: another agent may hold the task), and when `--timeout` has passed (a failed
attempt, reason `timeout`). A SIGKILL of the worker ends it too: a watchdog that outlives the
worker only for that (worker/process_group.py), and then removes the run's directory.

The worker outlives the server: a claim, heartbeat or outcome that cannot reach it is tried
again (with capped exponential backoff and jitter) until the server answers, and every write
carries an Idempotency-Key, so one repeated after a lost answer is replayed, not applied twice.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import IO

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
from nulltickets.config import ConfigError, parse_duration
from nulltickets.domain.model import ClaimResult
from nulltickets.lifetime import relay_signals
from nulltickets.worker.channel import MAX_REASON, Choice, Fail, Lease, RunDirectory
from nulltickets.worker.process_group import ProcessGroup

STDERR_TAIL = 4000  # bytes of stderr sent with a failed attempt
CONSOLE_LINES = 5  # lines of stderr the console shows for a failed attempt
STOP_BUDGET_S = 1.8  # from SIGTERM to the end of the release: the worker exits within 2 s
HEARTBEAT_MAX_S = 5.0  # heartbeats come every third of the lease TTL, at most this far apart
TIMEOUT_REASON = "timeout"
CREDENTIAL_MIN_LEN = 8  # a token this long is also looked for inside other variables' values

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


class Ending(Enum):
    """Why a command stopped running (or was made to)."""

    EXITED = "exited"  # on its own
    STOPPED = "stopped"  # the worker was asked to stop
    LOST = "lost"  # the server said the lease is gone (expired, superseded, cancelled)
    EXPIRED = "expired"  # no heartbeat reached the server for a whole lease TTL
    TIMED_OUT = "timed out"  # --timeout passed


class Phase(Enum):
    IDLE = "idle"  # claiming, or between tasks
    RUNNING = "running"  # a command runs; the main thread watches it
    SETTLING = "settling"  # recording an outcome with the server


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
    timeout_s: float | None = None  # end a command still running after this long
    retry: Retry = FOREVER

    def credentials(self) -> list[str]:
        """What the worker holds that its commands must never see."""
        return [self.token] if self.token else []


class Fatal(Exception):
    """The server refused the worker itself (a bad token, a bad flag): retrying cannot help."""


class Worker:
    def __init__(self, options: WorkerOptions) -> None:
        self.options = options
        self.stopping = threading.Event()
        self.stop_by: float | None = None  # when a stopping worker gives up on the server
        self.wake = threading.Event()  # something the main thread waits for has happened
        self.phase = Phase.IDLE
        self.api = self._client()
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
        """Ask the worker to stop: the command's group is ended, the task released, and the
        worker exits within STOP_BUDGET_S (a signal handler: it only sets flags and cuts)."""
        if self.stop_by is None:
            self.stop_by = time.monotonic() + STOP_BUDGET_S
        self.stopping.set()
        self.wake.set()
        if self.phase is Phase.RUNNING:
            return  # the main thread ends the command's group, then releases
        if self.phase is Phase.SETTLING:
            self._abort_at_stop_deadline()  # let the outcome be recorded, for a while
        else:
            self.api.abort()  # leave a long-polling claim now; the server claims nothing

    def _abort_at_stop_deadline(self) -> None:
        assert self.stop_by is not None
        timer = threading.Timer(max(0.0, self.stop_by - time.monotonic()), self.api.abort)
        timer.daemon = True
        timer.start()

    def _time_left(self, floor: float = 0.2) -> float:
        """Of the stop budget (or a few seconds when the worker is not stopping)."""
        if self.stop_by is None:
            return 5.0
        return max(floor, self.stop_by - time.monotonic())

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
        task, run = claimed.task, claimed.run
        task_json = json.dumps(json.loads(msgspec.json.encode(task)), indent=2).encode()
        checkpoint = json.loads(bytes(task.checkpoint)) or {}
        with RunDirectory(task_json, json.dumps(checkpoint).encode()) as run_dir:
            if self.stopping.is_set():  # stopped between the claim and the start
                return self._release(claimed, "worker stopped")
            self.log(f"task {task.id} attempt {run.attempt} (fence {claimed.fence})")
            # A claim repeated after a lost answer may hand back a lease that has expired
            # meanwhile: make sure it is still ours before any work is done under it.
            checked = time.monotonic()
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
            run_dir.offer_tools(self._lease(claimed), self_command())
            env = command_env(os.environ, self.options.credentials(), self._run_env(claimed))
            env.update(run_dir.env())
            return self._run_command(claimed, env, task_json, run_dir, checked)

    def _lease(self, claimed: ClaimResult) -> Lease:
        return Lease(
            base_url=self.options.base_url,
            task_id=claimed.task.id,
            run_id=claimed.run.id,
            lease_id=claimed.lease_id,
            lease_token=claimed.lease_token,
            fence=claimed.fence,
        )

    def _run_env(self, claimed: ClaimResult) -> dict[str, str]:
        task, run = claimed.task, claimed.run
        return {
            "NULLTICKETS_BASE_URL": self.options.base_url,
            "NULLTICKETS_TASK_ID": task.id,
            "NULLTICKETS_RUN_ID": run.id,
            "NULLTICKETS_LEASE_ID": claimed.lease_id,
            "NULLTICKETS_LEASE_TOKEN": claimed.lease_token,
            "NULLTICKETS_FENCE": str(claimed.fence),
            "NULLTICKETS_ATTEMPT": str(run.attempt),
            "NULLTICKETS_STAGE": task.stage,
        }

    def _run_command(
        self,
        claimed: ClaimResult,
        env: dict[str, str],
        task_json: bytes,
        run_dir: RunDirectory,
        lease_checked: float,
    ) -> Outcome:
        opts, task = self.options, claimed.task
        self.wake.clear()
        self.phase = Phase.RUNNING
        try:
            group = ProcessGroup(opts.command, env, on_exit=self.wake.set, leftover=run_dir.path)
        except OSError as exc:
            self.phase = Phase.IDLE
            error = f"cannot start command {opts.command[0]!r}: {exc}"
            return self._settle(claimed, lambda: self._fail(claimed, error))
        started = time.monotonic()
        beat = _Heartbeat(self, claimed, valid_until=lease_checked + _ttl_s(claimed))
        beat.start()
        tail: deque[bytes] = deque()
        proc = group.proc
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        streams = [
            threading.Thread(target=_feed, args=(proc.stdin, task_json), daemon=True),
            threading.Thread(target=_pump_stdout, args=(proc.stdout,), daemon=True),
            threading.Thread(target=_pump_stderr, args=(proc.stderr, tail), daemon=True),
        ]
        for t in streams:
            t.start()
        timeout_at = None if opts.timeout_s is None else started + opts.timeout_s
        # Still RUNNING until the outcome is settled or the task released: a stop meanwhile
        # only sets flags, it does not cut the client that is to record the outcome.
        try:
            ending = self._watch(group, beat, timeout_at)
            code = group.end()  # also what an exited command left running in its group
        finally:
            group.close()
            for t in streams:
                t.join(min(1.0, self._time_left()))  # EOF, unless something left the session
            beat.finish()
            self.phase = Phase.IDLE
        stderr = b"".join(tail).decode("utf-8", "replace")[-STDERR_TAIL:]
        match ending:
            case Ending.LOST:
                self.log(f"task {task.id}: lease lost ({beat.lost}); command stopped")
                return Outcome.LOST
            case Ending.EXPIRED:
                self.log(
                    f"task {task.id}: lease expired, no heartbeat reached the server for "
                    f"{beat.ttl_s:.1f} s; command stopped"
                )
                return Outcome.LOST
            case Ending.STOPPED:
                return self._release(claimed, "worker stopped")
            case Ending.TIMED_OUT:
                assert opts.timeout_s is not None
                limit = _seconds(opts.timeout_s)
                self.log(f"task {task.id} attempt {claimed.run.attempt} failed: timeout ({limit})")
                error = f"{TIMEOUT_REASON}: the command ran longer than {limit}"
                return self._settle(claimed, lambda: self._fail(claimed, error))
            case Ending.EXITED:
                return self._settle(claimed, lambda: self._record(claimed, code, stderr, run_dir))

    def _watch(self, group: ProcessGroup, beat: _Heartbeat, timeout_at: float | None) -> Ending:
        """Wait for the first reason the command stops running; the order settles ties."""
        while True:
            now = time.monotonic()
            if beat.lost is not None:
                return Ending.LOST
            if self.stopping.is_set():
                return Ending.STOPPED
            if group.exited.is_set():
                return Ending.EXITED
            if now >= beat.valid_until:
                return Ending.EXPIRED
            if timeout_at is not None and now >= timeout_at:
                return Ending.TIMED_OUT
            until = beat.valid_until if timeout_at is None else min(beat.valid_until, timeout_at)
            # Every flag above is set before `wake`, so a wake-up between the checks and the
            # wait is not missed, and one the clear() swallows has its flag seen next round.
            self.wake.wait(until - now)
            self.wake.clear()

    # --- recording the outcome -----------------------------------------------------------------

    def _settle(self, claimed: ClaimResult, record: Callable[[], Outcome]) -> Outcome:
        """Run `record`, which retries until the server says yes or no for good; a stopping
        worker gives it until its stop deadline."""
        self.phase = Phase.SETTLING
        try:
            if self.stopping.is_set():
                self._abort_at_stop_deadline()
            return record()
        except ClientAborted:
            self.log(
                f"task {claimed.task.id}: stopped before the outcome was recorded; "
                "lease will expire"
            )
            return Outcome.UNRECORDED
        finally:
            self.phase = Phase.IDLE

    def _record(
        self, claimed: ClaimResult, exit_code: int, stderr: str, run_dir: RunDirectory
    ) -> Outcome:
        """The outcome the command chose and its exit status say, recorded."""
        task_id, attempt = claimed.task.id, claimed.run.attempt
        try:
            choice: Choice | None = run_dir.chosen()
        except ValueError as exc:
            self.log(f"task {task_id} attempt {attempt} failed: {exc}")
            return self._fail(claimed, f"the command's chosen outcome is unreadable: {exc}")
        if isinstance(choice, Fail):
            reason = choice.error[:MAX_REASON]
            first = reason.strip().splitlines()[0] if reason.strip() else ""
            self.log(f"task {task_id} attempt {attempt} failed (nulltickets fail): {first}")
            return self._fail(claimed, reason)
        if exit_code != 0:
            why = _exit_reason(exit_code)
            if choice is not None:
                why += f" (transition {choice.trigger!r} not taken)"
            lines = stderr.rstrip().splitlines()[-CONSOLE_LINES:]
            shown = "".join(f"\n    | {line}" for line in lines)
            self.log(f"task {task_id} attempt {attempt} failed: {why}{shown}")
            return self._fail(claimed, f"{why}\n{stderr}".strip())
        trigger = choice.trigger if choice is not None else None
        trigger = trigger or self.options.trigger or _only_trigger(claimed)
        if trigger is None:
            error = (
                "command succeeded but chose no transition (nulltickets transition), no "
                "--trigger was given and the stage has several transitions"
            )
            return self._fail(claimed, error)
        try:
            moved = self.api.transition(
                claimed.run.id, claimed.lease_token, trigger, expected_fence=claimed.fence
            )
        except ApiError as exc:
            if exc.lease_lost:
                self.log(f"task {task_id}: transition refused, lease lost ({exc})")
                return Outcome.LOST
            # A trigger the stage does not have, say: fail now, not at lease expiry.
            self.log(f"task {task_id}: transition {trigger!r} refused ({exc})")
            return self._fail(claimed, f"transition {trigger!r} refused: {exc}")
        self.log(f"task {task_id}: {moved.previous_stage} -> {moved.new_stage}")
        return Outcome.MOVED

    def _fail(self, claimed: ClaimResult, error: str) -> Outcome:
        try:
            self.api.fail(claimed.run.id, claimed.lease_token, error, expected_fence=claimed.fence)
        except ApiError as exc:
            self.log(f"task {claimed.task.id}: failure not recorded ({exc})")
        return Outcome.FAILED

    def _release(self, claimed: ClaimResult, reason: str) -> Outcome:
        opts = self.options
        # A stopping worker tries until its stop deadline only: the lease expires otherwise.
        left = self._time_left()
        api = Client(opts.base_url, opts.token, timeout=left, retry=Retry(timeout=left))
        cut = threading.Timer(left, api.abort)  # the deadline holds inside a slow answer too
        cut.daemon = True
        cut.start()
        try:
            api.release(claimed.run.id, claimed.lease_token, reason, expected_fence=claimed.fence)
            self.log(f"task {claimed.task.id}: released")
        except (ApiError, OSError) as exc:
            self.log(f"task {claimed.task.id}: could not release: {exc}")
        finally:
            cut.cancel()
            api.close()
        return Outcome.RELEASED


class _Heartbeat:
    """Extends the lease every third of its TTL (at most HEARTBEAT_MAX_S apart) while the
    command runs. A heartbeat that cannot reach the server is retried (the command keeps
    running); a definitive refusal (expired, superseded, cancelled) sets `lost`.
    `valid_until` is the moment (monotonic) before which the lease is surely still ours: a
    whole TTL after the last heartbeat the server accepted was sent. Past it, the server has
    let the lease expire and another agent may hold the task."""

    def __init__(self, worker: Worker, claimed: ClaimResult, valid_until: float) -> None:
        self.worker, self.claimed = worker, claimed
        self.ttl_s = _ttl_s(claimed)
        self.period = min(self.ttl_s / 3, HEARTBEAT_MAX_S)
        self.valid_until = valid_until
        self.lost: ApiError | None = None
        self.done = threading.Event()
        opts = worker.options
        # A hung server must not hold a heartbeat past the lease: give up an attempt early.
        self.api = Client(
            opts.base_url,
            opts.token,
            timeout=max(1.0, self.period),
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
        self.thread.join(1.0)
        self.api.close()

    def _retrying(self, event: RetryEvent) -> None:
        self.failures += 1
        if event.attempt & (event.attempt - 1) == 0:
            self.worker.log(f"task {self.claimed.task.id}: heartbeat: {event.reason}; retrying")

    def _beat(self) -> None:
        c = self.claimed
        while not self.done.wait(self.period):
            sent = time.monotonic()  # the server extends the lease from a moment after this
            try:
                self.api.heartbeat(c.lease_id, c.lease_token, expected_fence=c.fence)
            except ClientAborted:
                return
            except ApiError as exc:
                if not exc.lease_lost:
                    self.worker.log(f"task {c.task.id}: heartbeat refused ({exc})")
                    continue
                self.lost = exc
                self.worker.wake.set()
                return
            self.valid_until = sent + self.ttl_s
            if self.failures:
                self.worker.log(f"task {c.task.id}: heartbeat reached the server again")
                self.failures = 0


def command_env(
    inherited: Mapping[str, str], credentials: Iterable[str], run: Mapping[str, str]
) -> dict[str, str]:
    """The environment a command runs in: `inherited` without any NULLTICKETS_* variable (the
    worker's own: its token, key or database may be among them) and without any variable that
    holds one of `credentials` (the worker's token under another name), plus `run`."""
    secrets = [c for c in credentials if c]

    def holds_secret(value: str) -> bool:
        return any(value == s or (len(s) >= CREDENTIAL_MIN_LEN and s in value) for s in secrets)

    env = {
        name: value
        for name, value in inherited.items()
        if not name.upper().startswith("NULLTICKETS_") and not holds_secret(value)
    }
    env.update(run)
    return env


def self_command() -> list[str]:
    """How to start this program again: the standalone binary itself (in Nuitka's onefile
    child, argv[0] is the binary's absolute path), else this Python with `-m nulltickets`."""
    if "__compiled__" in globals():  # defined in every module Nuitka compiled
        return [os.path.abspath(sys.argv[0])]
    return [sys.executable, "-m", "nulltickets"]


def _ttl_s(claimed: ClaimResult) -> float:
    started = claimed.run.started_at_ms or claimed.expires_at_ms
    return max(0.3, (claimed.expires_at_ms - started) / 1000)


def _seconds(value: float) -> str:
    return f"{value:g} s"


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


def _feed(stdin: IO[bytes], data: bytes) -> None:
    """The task on the command's stdin, from a thread: a command that never reads it (and a
    task larger than the pipe's buffer) must not hold up the worker."""
    try:
        stdin.write(data)
        stdin.close()
    except OSError:  # the command exited, or closed its stdin
        pass


def _pump_stdout(stdout: IO[bytes]) -> None:
    """The command's stdout to the worker's: a log, nothing in it is acted upon."""
    for raw in stdout:
        sys.stdout.buffer.write(raw)
        sys.stdout.buffer.flush()
    stdout.close()


def _pump_stderr(stderr: IO[bytes], tail: deque[bytes]) -> None:
    kept = 0
    for raw in stderr:
        sys.stderr.buffer.write(raw)
        sys.stderr.buffer.flush()  # a log being followed shows each line as the command writes it
        tail.append(raw)
        kept += len(raw)
        while kept > STDERR_TAIL * 2 and len(tail) > 1:
            kept -= len(tail.popleft())
    stderr.close()


def run_worker(options: WorkerOptions) -> int:
    worker = Worker(options)
    signal.signal(signal.SIGTERM, worker.stop)
    signal.signal(signal.SIGINT, worker.stop)
    # The main thread waits up to a lease's renewal while a command runs: a signal the kernel
    # gives to another thread must not wait for it.
    relay_signals(worker.stop, (signal.SIGTERM, signal.SIGINT))
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
        help="the server's admin token, if it has one (default: $NULLTICKETS_TOKEN); never "
        "passed to the command",
    )
    parser.add_argument(
        "--agent-id", default=None, help="the agent id claims are made as (default: HOST-PID)"
    )
    parser.add_argument(
        "--trigger",
        default=None,
        help="the trigger to move a task along when the command exits 0 and chose none "
        "with `nulltickets transition` (default: the stage's only transition)",
    )
    parser.add_argument(
        "--timeout",
        default=None,
        metavar="DURATION",
        help="end a command still running after this long (30s, 5m, 1h, 1h30m) and fail the "
        "attempt with reason timeout (default: no limit)",
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
    timeout_s = None
    if args.timeout is not None:
        try:
            timeout_s = parse_duration(args.timeout, "--timeout")
        except ConfigError as exc:
            return _usage(str(exc))
        if timeout_s <= 0:
            return _usage("--timeout must be positive")
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
        timeout_s=timeout_s,
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
