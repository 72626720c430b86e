"""A command run in a session (and so a process group) of its own, ended as a whole: the
command and everything it started, also when the process that started it is SIGKILLed.

While this process lives it ends the group itself (`ProcessGroup.end`: SIGTERM, then SIGKILL to
whatever is left after GRACE_S). For when it cannot (SIGKILL), a watchdog stands by: a tiny
`/bin/sh` in a session of its own that holds the read end of a pipe whose write end only this
process holds. It is started before the command and told the group on the pipe, so it stands by
before anything of the command's runs. When this process dies the kernel closes that end, the
watchdog reads EOF, ends the group the same way, removes what it was told to (the run's
directory, which holds the run's lease token: no one else is left to remove it) and exits. On
Linux the watchdog also gets SIGHUP from the kernel when this process dies (PR_SET_PDEATHSIG), a
second line should the pipe be held open somewhere, and the command's first process gets
SIGTERM. Once the group is ended here, the watchdog is SIGKILLed: it never outlives its group's
end. A process that leaves the session on purpose (`setsid`, a daemon) is out of reach. On
Windows there are no process groups: only the command is ended.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from nulltickets.lifetime import end_with_this_process

POSIX = os.name == "posix"
LINUX = sys.platform.startswith("linux")
GRACE_S = 1.0  # between SIGTERM and SIGKILL of a group that must end
POLL_S = 0.02  # how often a group being ended is looked at

# The first line of stdin: the group to end (EOF first: no command was started). Then it reads
# stdin until EOF (the worker gone), or is told by a signal: SIGHUP from the kernel when the
# worker dies, TERM or INT from anyone (a service manager ending every process of the unit
# while the worker, alive, ends its run itself). $1, when not empty: a directory to remove once
# the group is ended, only when the worker is gone (an argument, never the script's text).
WATCHDOG = f"""
d="$1"
trap 'exit 0' HUP TERM INT
read -r g || exit 0
# While the group has a process, at most $1 tenths of a second.
wait_group() {{
    i=0
    while [ "$i" -lt "$1" ] && kill -s 0 -- "-$g" 2>/dev/null; do
        sleep 0.1
        i=$((i + 1))
    done
}}
end() {{
    if kill -s TERM -- "-$g" 2>/dev/null; then
        wait_group {round(GRACE_S * 10)}
        kill -s KILL -- "-$g" 2>/dev/null
    fi
    if [ "$1" = gone ] && [ -n "$d" ]; then
        wait_group 50
        rm -rf -- "$d"
    fi
    exit 0
}}
trap 'end gone' HUP
trap end TERM INT
read -r _
end gone
"""


class ProcessGroup:
    """`argv` started with pipes for stdin, stdout and stderr, in a new session (POSIX).

    `exited` is set once the command's first process has exited (not reaped yet: while it is a
    zombie its pid, the group's id, cannot be given to another process); `on_exit` is called
    then, from another thread. `end()` ends the whole group and reaps the command; `close()`
    ends the watchdog. `leftover`: a directory the watchdog removes if it has to end the group
    (this process was killed, and cannot remove it itself). Raises OSError when the command
    cannot be started."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        on_exit: Callable[[], None] | None = None,
        leftover: Path | None = None,
    ) -> None:
        self.on_exit = on_exit
        self.exited = threading.Event()
        self.watchdog: subprocess.Popen[bytes] | None = None
        self._hold = self._watch(leftover) if POSIX else None
        try:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                start_new_session=POSIX,
                # The first line when this process is SIGKILLed, from the kernel itself.
                preexec_fn=end_with_this_process(),
            )
        except BaseException:
            self.close()
            raise
        self.pgid = self.proc.pid
        if self._hold is not None:
            os.write(self._hold, b"%d\n" % self.pgid)  # the watchdog's first line
        threading.Thread(target=self._wait_exit, daemon=True).start()

    def _watch(self, leftover: Path | None) -> int | None:
        """Start the watchdog; it learns the group once the command is started. The write end
        of its pipe, which only this process holds (None: no watchdog)."""
        read, write = os.pipe()  # neither end is inherited by the command or anything else
        try:
            self.watchdog = subprocess.Popen(
                ["/bin/sh", "-c", WATCHDOG, "nulltickets-watchdog", str(leftover or "")],
                stdin=read,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C for the worker's terminal is not for it
                preexec_fn=end_with_this_process(signal.SIGHUP),
            )
        except OSError:
            os.close(write)  # no /bin/sh: the kernel's SIGTERM to the command remains
            return None
        finally:
            os.close(read)
        return write

    def _wait_exit(self) -> None:
        if hasattr(os, "waitid"):
            with contextlib.suppress(ChildProcessError):
                os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOWAIT)
        else:  # macOS before Python 3.13: reaped at once
            self.proc.wait()
        self.exited.set()
        if self.on_exit is not None:
            self.on_exit()

    def end(self, grace: float = GRACE_S) -> int:
        """End the group (SIGTERM; SIGKILL to what is left after `grace` s) and reap the
        command; its exit status (negative: the signal that ended it). Also after the command
        has exited on its own: anything it left running in its group is ended too."""
        if not POSIX:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    return self.proc.wait(grace)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
            return self.proc.wait()
        self._signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while self._alive():
            if time.monotonic() >= deadline:
                self._signal(signal.SIGKILL)
                break
            time.sleep(POLL_S)
        return self.proc.wait()

    def close(self) -> None:
        """SIGKILL the watchdog (the group is ended, or about to be by the caller) and reap it."""
        watchdog, self.watchdog = self.watchdog, None
        if watchdog is not None:
            with contextlib.suppress(ProcessLookupError):
                watchdog.kill()
            watchdog.wait()
        hold, self._hold = self._hold, None
        if hold is not None:
            os.close(hold)

    def _signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, signum)

    def _alive(self) -> bool:
        """Whether a process of the group still runs (zombies do not)."""
        if LINUX:
            return _live_member(self.pgid)
        if not self.exited.is_set():
            return True
        self.proc.wait()  # the group's id stays ours while a member holds it
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _live_member(pgid: int) -> bool:
    """Linux: whether a process of group `pgid` runs (is not a zombie), from /proc."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_bytes()
        except OSError:  # gone meanwhile
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False
