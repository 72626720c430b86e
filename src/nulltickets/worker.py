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
the task (not a failed attempt). A lost lease (expired, superseded) stops the command and the
worker leaves the task to its new holder.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from nulltickets.client import ApiError, Client
from nulltickets.domain.model import ClaimResult

TRIGGER_PREFIX = "nulltickets:trigger="
STDERR_TAIL = 4000
STOP_GRACE_S = 10.0


@dataclass
class WorkerOptions:
    role: str
    command: list[str]
    base_url: str = "http://127.0.0.1:7700"
    token: str | None = None
    agent_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    trigger: str | None = None
    lease_ttl_ms: int | None = None
    wait_ms: int = 30_000
    max_tasks: int | None = None  # stop after this many tasks
    exit_when_idle: bool = False  # stop at the first empty claim


class Worker:
    def __init__(self, options: WorkerOptions) -> None:
        self.options = options
        self.api = Client(options.base_url, options.token)
        self.stopping = threading.Event()
        self.child: subprocess.Popen[bytes] | None = None
        self.done = 0

    def log(self, message: str) -> None:
        print(f"nulltickets worker {self.options.agent_id}: {message}", file=sys.stderr, flush=True)

    def stop(self, signum: int = signal.SIGTERM, frame: object = None) -> None:
        """Ask the worker to stop: the command gets SIGTERM, the task is released."""
        self.stopping.set()
        child = self.child
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)
        elif child is None:
            self.api.abort()  # leave a long-polling claim now; the server claims nothing

    def run(self) -> int:
        opts = self.options
        while not self.stopping.is_set():
            if opts.max_tasks is not None and self.done >= opts.max_tasks:
                break
            try:
                claimed = self.api.claim(
                    opts.agent_id, opts.role, lease_ttl_ms=opts.lease_ttl_ms, wait_ms=opts.wait_ms
                )
            except (ApiError, OSError) as exc:
                if self.stopping.is_set():
                    break
                self.log(f"claim failed: {exc}; retrying")
                self.stopping.wait(1.0)
                continue
            if claimed is None:
                if opts.exit_when_idle:
                    break
                continue
            self.work(claimed)
            self.done += 1
        self.api.close()
        return 0

    def work(self, claimed: ClaimResult) -> None:
        opts = self.options
        task, run = claimed.task, claimed.run
        lost = threading.Event()
        with tempfile.TemporaryDirectory(prefix="nulltickets-run-") as tmp:
            task_json = json.dumps(json.loads(_encode(task)), indent=2)
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
                self.api = Client(opts.base_url, opts.token)
                self._release(claimed, "worker stopped")
                return
            self.log(f"task {task.id} attempt {run.attempt} (fence {claimed.fence})")
            beating = threading.Thread(target=self._heartbeat, args=(claimed, lost), daemon=True)
            try:
                self.child = subprocess.Popen(
                    opts.command,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env=env,
                )
            except OSError as exc:
                self._settle(
                    claimed,
                    exit_code=127,
                    stderr=f"cannot start command: {exc}",
                    printed_trigger=None,
                )
                return
            beating.start()
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
            lost.set()  # stops the heartbeat thread
            beating.join(5)
            stderr = b"".join(tail).decode("utf-8", "replace")[-STDERR_TAIL:]
            if getattr(lost, "superseded", False):
                self.log(f"task {task.id}: lease lost while running; left to its new holder")
                return
            if self.stopping.is_set():
                self.api = Client(opts.base_url, opts.token)  # the old one may be aborted
                self._release(claimed, "worker stopped")
                return
            self._settle(claimed, code, stderr, printed[-1] if printed else None)

    def _heartbeat(self, claimed: ClaimResult, lost: threading.Event) -> None:
        ttl_s = max(0.3, (claimed.expires_at_ms - claimed.run.started_at_ms) / 1000)  # type: ignore[operator]
        beat = Client(self.options.base_url, self.options.token)
        try:
            while not lost.wait(ttl_s / 3):
                try:
                    beat.heartbeat(
                        claimed.lease_id, claimed.lease_token, expected_fence=claimed.fence
                    )
                except ApiError as exc:
                    if exc.status in (404, 409, 410):  # the lease is gone or superseded
                        lost.superseded = True  # type: ignore[attr-defined]
                        child = self.child
                        if child is not None and child.poll() is None:
                            child.send_signal(signal.SIGTERM)
                        return
                except OSError:
                    pass  # the server is restarting: keep trying within the TTL
        finally:
            beat.close()

    def _settle(
        self, claimed: ClaimResult, exit_code: int, stderr: str, printed_trigger: str | None
    ) -> None:
        run, fence = claimed.run, claimed.fence
        try:
            if exit_code == 0:
                trigger = printed_trigger or self.options.trigger or _only_trigger(claimed)
                if trigger is None:
                    self.api.fail(
                        run.id,
                        claimed.lease_token,
                        "command succeeded but no trigger was given or printed and "
                        "the stage has several transitions",
                        expected_fence=fence,
                    )
                    return
                moved = self.api.transition(
                    run.id, claimed.lease_token, trigger, expected_fence=fence
                )
                self.log(f"task {claimed.task.id}: {moved.previous_stage} -> {moved.new_stage}")
            else:
                error = f"command exited with status {exit_code}\n{stderr}".strip()
                self.api.fail(run.id, claimed.lease_token, error, expected_fence=fence)
                self.log(f"task {claimed.task.id}: failed (exit {exit_code})")
        except ApiError as exc:
            self.log(f"task {claimed.task.id}: could not record the outcome: {exc}")
        except OSError as exc:
            self.log(f"task {claimed.task.id}: server unreachable: {exc}; lease will expire")

    def _release(self, claimed: ClaimResult, reason: str) -> None:
        try:
            self.api.release(
                claimed.run.id, claimed.lease_token, reason, expected_fence=claimed.fence
            )
            self.log(f"task {claimed.task.id}: released")
        except (ApiError, OSError) as exc:
            self.log(f"task {claimed.task.id}: could not release: {exc}")


def _only_trigger(claimed: ClaimResult) -> str | None:
    triggers = {t.trigger for t in claimed.task.available_transitions}
    return triggers.pop() if len(triggers) == 1 else None


def _encode(value: object) -> bytes:
    import msgspec

    return msgspec.json.encode(value)


def _pump_stdout(child: subprocess.Popen[bytes], printed: list[str]) -> None:
    assert child.stdout is not None
    for raw in child.stdout:
        line = raw.decode("utf-8", "replace")
        sys.stdout.write(line)
        stripped = line.strip()
        if stripped.startswith(TRIGGER_PREFIX):
            printed.append(stripped[len(TRIGGER_PREFIX) :])
    sys.stdout.flush()


def _pump_stderr(child: subprocess.Popen[bytes], tail: deque[bytes]) -> None:
    assert child.stderr is not None
    kept = 0
    for raw in child.stderr:
        sys.stderr.buffer.write(raw)
        tail.append(raw)
        kept += len(raw)
        while kept > STDERR_TAIL * 2 and len(tail) > 1:
            kept -= len(tail.popleft())
    sys.stderr.flush()


def run_worker(options: WorkerOptions) -> int:
    worker = Worker(options)
    signal.signal(signal.SIGTERM, worker.stop)
    signal.signal(signal.SIGINT, worker.stop)
    started = time.monotonic()
    code = worker.run()
    worker.log(f"stopped after {worker.done} task(s) in {time.monotonic() - started:.1f} s")
    return code
