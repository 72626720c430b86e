"""Which core runs, and that the compiled and interpreted cores agree."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import nulltickets._cext.core as built

from nulltickets import core
from nulltickets.domain.fsm import parse_definition
from tests.server import PIPELINE


def test_the_reported_implementation_is_the_one_loaded() -> None:
    is_extension = Path(built.__file__).suffix in (".so", ".pyd")
    assert built.COMPILED is is_extension
    forced = os.environ.get("NULLTICKETS_PURE_PYTHON", "") not in ("", "0")
    expected = "compiled" if is_extension and not forced else "python"
    assert expected == core.IMPLEMENTATION
    if os.environ.get("NULLTICKETS_REQUIRE_COMPILED") == "1" and not forced:
        assert core.IMPLEMENTATION == "compiled", "the build was expected to compile the core"


def test_compiled_and_interpreted_cores_decide_alike() -> None:
    interpreted, loaded = core.load(pure_python=True), core.load()
    pipeline = parse_definition(PIPELINE)
    grid = itertools.product(
        (None, -1, 0, 1, 3),
        (0, 250, -5),
        ("dead", "nowhere", None),
        (1, 2, 3, 7),
        (1.0, 1.5),
        (None, 400),
        (0.0, 0.3),
    )
    for max_attempts, delay, dl, failed, backoff, cap, jitter in grid:
        args = dict(
            stage="todo",
            max_attempts=max_attempts,
            retry_delay_ms=delay,
            dead_letter_stage=dl,
            pipeline=pipeline,
            failed_attempts=failed,
            now=10_000,
            backoff=backoff,
            max_delay_ms=cap,
            jitter=jitter,
            rand=0.25,
        )
        a, b = interpreted.decide_failure(**args), loaded.decide_failure(**args)
        assert (type(a).__name__, vars(a) if hasattr(a, "__dict__") else repr(a)) == (
            type(b).__name__,
            vars(b) if hasattr(b, "__dict__") else repr(b),
        )


def test_a_build_that_must_be_compiled_has_the_wal_sync_threads_too() -> None:
    """Where the core must be compiled (CI), the WAL sync threads in C must be there as well on
    a POSIX system, so that their tests run rather than being skipped."""
    if os.environ.get("NULLTICKETS_REQUIRE_COMPILED") != "1" or os.name != "posix":
        return
    import nulltickets._cext.walsync as native

    assert Path(native.__file__).suffix == ".so"
