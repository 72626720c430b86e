"""Signals relayed from whichever thread takes them (lifetime.relay_signals) and the exit
deadline (lifetime.exit_after), each case in a fresh interpreter so this process's own
handlers stay as they are."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


RELAYED = """
import signal, threading, time
from nulltickets.lifetime import relay_signals
got = []
signal.signal(signal.SIGUSR1, lambda s, f: None)
relay_signals(lambda s, f: got.append((s, threading.current_thread().name)), [signal.SIGUSR1])
signal.raise_signal(signal.SIGUSR1)
deadline = time.monotonic() + 10
while not got and time.monotonic() < deadline:
    time.sleep(0.01)
print(got)
"""


def test_a_relayed_signal_runs_the_handler_on_the_relay_thread() -> None:
    assert run(RELAYED) == f"[({int(__import__('signal').SIGUSR1)}, 'nulltickets-signals')]"


FORKED = """
import os, signal
from nulltickets.lifetime import relay_signals
signal.signal(signal.SIGTERM, lambda s, f: None)
relay_signals(lambda s, f: None)
pid = os.fork()
if pid == 0:  # the child has no relay thread: no signal of its may go to the parent's
    os._exit(0 if signal.set_wakeup_fd(-1) == -1 else 1)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), signal.set_wakeup_fd(-1) >= 0)
"""


def test_a_forked_child_does_not_write_its_signals_to_the_parents_relay() -> None:
    assert run(FORKED) == "0 True"


IN_USE = """
import os, signal
from nulltickets.lifetime import relay_signals
read, write = os.pipe()
os.set_blocking(write, False)
signal.set_wakeup_fd(write)
relay_signals(lambda s, f: None)
print(signal.set_wakeup_fd(-1) == write)
"""


def test_a_wakeup_fd_already_in_use_is_left_as_it_is() -> None:
    assert run(IN_USE) == "True"


HELD_GIL = """
import ctypes
from nulltickets.lifetime import exit_after
exit_after(0.2)
ctypes.PyDLL(None).pause()  # a native call that blocks holding the GIL: the exit thread cannot run
"""


def test_the_exit_deadline_ends_a_process_whose_gil_is_held_for_good() -> None:
    """A library that deadlocks while holding the GIL (granian's stop signal set twice did)
    also holds the deadline's thread: the kernel's timer ends the process anyway."""
    done = subprocess.run(
        [sys.executable, "-c", HELD_GIL], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == -signal.SIGALRM, (done.returncode, done.stderr)
