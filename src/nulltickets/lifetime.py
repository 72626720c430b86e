"""Processes of ours end with the process that depends on them: on Linux through the kernel's
parent-death signal (PR_SET_PDEATHSIG), which a SIGKILL of the parent cannot skip (elsewhere
those do nothing); and a process asked to stop is gone within a deadline, whatever it was
doing."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from types import FrameType
from typing import cast

PR_SET_PDEATHSIG = 1

# The signals that stop a server gracefully. SIGHUP among them, as the original stops on it: a
# terminal or a supervisor's process group that hangs up must not leave a server behind
# (granian alone respawns its worker on SIGHUP and serves on, with parent pid 1).
STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT) + (
    (signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ()
)

# How long after its own deadline the kernel ends a process whose exit thread could not run.
EXIT_BACKSTOP_S = 1.0

log = logging.getLogger("nulltickets")
_exiting = threading.Event()


def exit_after(seconds: float) -> None:
    """The last resort of a shutdown: if this process has not exited by then (a request that
    never ends, a stuck call, a child that will not die), it leaves without waiting further.
    Only the first call in a process arms it.

    A thread leaves at `seconds`; it needs the GIL to run, and a native call that blocks while
    holding it (a library's deadlock) would hold the thread too. So the kernel's own timer
    also ends the process, EXIT_BACKSTOP_S later, with SIGALRM, whose default action ends a
    process without running any of its code (nothing here sets a handler for it)."""
    if _exiting.is_set():
        return
    _exiting.set()
    if hasattr(signal, "setitimer") and signal.getsignal(signal.SIGALRM) == signal.SIG_DFL:
        with contextlib.suppress(OSError):
            signal.setitimer(signal.ITIMER_REAL, seconds + EXIT_BACKSTOP_S)

    def leave() -> None:
        time.sleep(seconds)
        log.warning("shutdown took longer than %.1f s: exiting now", seconds)
        os._exit(1)

    threading.Thread(target=leave, name="nulltickets-exit-deadline", daemon=True).start()


def relay_signals(
    handler: Callable[[int, FrameType | None], object], signals: Iterable[int] = STOP_SIGNALS
) -> None:
    """Also run `handler` for `signals` from a thread of its own, as soon as one arrives.

    The kernel gives a process's signal to any of its threads that can take it, not always the
    main thread: not while the main thread is stopped (a stopped job sent SIGTERM by `kill %1`,
    or hung up as an orphaned group), nor while it has a signal pending. Python runs its
    handlers only in the main thread, when it next runs code, and a main thread waiting on a
    lock without a timeout (granian's main loop) would then never run it. Python writes each
    signal's number to the wakeup fd from whichever thread took it; the relay reads it there.
    The main thread's handler still runs when it wakes: `handler` must bear a second call.
    Call it from the main thread once the handlers are set; it does nothing where there is no
    such fd (Windows, where the main thread takes every signal) or one is already in use."""
    if sys.platform == "win32":
        return
    wanted = frozenset(int(s) for s in signals)
    read, write = os.pipe()
    os.set_blocking(write, False)
    try:
        previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    except ValueError:  # not the main thread
        previous = -2
    if previous != -1:  # someone else's (an event loop's), or not ours to set
        if previous >= 0:
            signal.set_wakeup_fd(previous)
        os.close(read)
        os.close(write)
        return

    def relay() -> None:
        while True:
            for signum in os.read(read, 64):
                if signum in wanted:
                    handler(signum, None)

    def forget() -> None:  # in a forked child (granian's worker): no relay there, nor its fd
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(-1)
        os.close(read)
        os.close(write)

    os.register_at_fork(after_in_child=forget)
    threading.Thread(target=relay, name="nulltickets-signals", daemon=True).start()


@functools.cache
def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return cast("Callable[..., int]", ctypes.CDLL(None, use_errno=True).prctl)
    except (OSError, AttributeError):
        return None


def follow_onefile_parent() -> None:
    """In the standalone binary this process is the child of the onefile bootstrap, the
    process a supervisor started and may SIGKILL. On Linux the kernel then sends us SIGTERM
    and the command's own stop follows (the server's bounded shutdown, the worker's release),
    instead of the bootstrap's own watch, which gives its child a long grace time first.
    Elsewhere that watch stays."""
    parent = os.environ.get("NUITKA_ONEFILE_PARENT")
    prctl = _prctl()
    if not parent or prctl is None:
        return
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if str(os.getppid()) != parent:  # it was gone before the line above
        os.kill(os.getpid(), signal.SIGTERM)


def end_with_this_process(signum: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` for a child that must get `signum` (SIGTERM) when this process dies, even
    by SIGKILL, or None where there is no such signal. The kernel watches the thread that starts
    the child: start it from a thread that lives as long as the process (the main thread)."""
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def arm() -> None:  # in the child, between fork and exec: nothing but two system calls
        prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)
        if os.getppid() != parent:  # this process died before the line above
            os._exit(128 + signum)

    return arm
