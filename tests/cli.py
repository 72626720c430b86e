"""Run the `nulltickets` command as a person would: a subprocess, its own home directory."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

from tests.server import server_command


def run_cli(
    *args: str,
    home: Path,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 60.0,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """`nulltickets ARGS...` to completion, with NULLTICKETS_HOME=home and no inherited
    NULLTICKETS_* variable (so a developer's own settings never leak in)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("NULLTICKETS_")}
    if "NULLTICKETS_BINARY" in os.environ:
        base["NULLTICKETS_BINARY"] = os.environ["NULLTICKETS_BINARY"]
    full_env = {**base, "NULLTICKETS_HOME": str(home), **(env or {})}
    # A session of its own, so that a command which should have failed but started a server
    # is stopped with all its processes when the test gives up on it.
    proc = subprocess.Popen(
        [*server_command(), *args],
        stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    """The single line the command wrote on stderr (fails if there are more, or none)."""
    err = result.stderr
    assert err.endswith("\n") and err.count("\n") == 1, repr(err)
    assert err.startswith("nulltickets: "), repr(err)
    assert "Traceback" not in err
    return err[len("nulltickets: ") : -1]
