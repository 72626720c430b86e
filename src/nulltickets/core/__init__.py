"""The claim/transition/fail decisions, from the compiled core when it was built, else from
its interpreted source. Every caller imports from here.

The source is `cext/core.py` (installed as `nulltickets._cext.core`); a C compiler at build
time turns it into an extension module of the same name, which Python then prefers.
NULLTICKETS_PURE_PYTHON=1 loads the interpreted source even where the compiled one exists.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import nulltickets._cext
from nulltickets.domain.fsm import Transition


def _interpreted() -> ModuleType:
    """The source of the core, loaded as Python even when a compiled module sits beside it."""
    name = "nulltickets._cext.core_interpreted"
    if name in sys.modules:
        return sys.modules[name]
    path = Path(nulltickets._cext.__file__).with_name("core.py")
    loader = importlib.machinery.SourceFileLoader(name, str(path))
    spec = importlib.util.spec_from_loader(name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    return module


def load(pure_python: bool = False) -> ModuleType:
    if pure_python:
        return _interpreted()
    import nulltickets._cext.core as impl

    loaded: ModuleType = impl  # the compiled module when it was built, else the source
    return loaded


_impl = load(os.environ.get("NULLTICKETS_PURE_PYTHON", "") not in ("", "0"))

IMPLEMENTATION = "compiled" if _impl.COMPILED else "python"

# The names callers use (typed by the source in cext/core.py, which mypy checks on its own).
DEAD_LETTER_ELIGIBLE_AT: int = _impl.DEAD_LETTER_ELIGIBLE_AT
DEFAULT_LEASE_TTL_MS: int = _impl.DEFAULT_LEASE_TTL_MS
DEFAULT_IMMEDIATE_RETRIES: int = _impl.DEFAULT_IMMEDIATE_RETRIES
DEFAULT_RETRY_DELAY_MS: int = _impl.DEFAULT_RETRY_DELAY_MS
DEFAULT_RETRY_MAX_DELAY_MS: int = _impl.DEFAULT_RETRY_MAX_DELAY_MS
MAX_LEASE_TTL_MS: int = _impl.MAX_LEASE_TTL_MS
DeadLettered: Any = _impl.DeadLettered
RetryScheduled: Any = _impl.RetryScheduled
decide_failure: Callable[..., Any] = _impl.decide_failure
default_retry_delay: Callable[..., int] = _impl.default_retry_delay
decide_transition: Callable[..., Transition] = _impl.decide_transition
lease_ttl: Callable[..., int] = _impl.lease_ttl
retry_delay: Callable[..., int] = _impl.retry_delay

__all__ = [
    "DEAD_LETTER_ELIGIBLE_AT",
    "DEFAULT_IMMEDIATE_RETRIES",
    "DEFAULT_LEASE_TTL_MS",
    "DEFAULT_RETRY_DELAY_MS",
    "DEFAULT_RETRY_MAX_DELAY_MS",
    "IMPLEMENTATION",
    "MAX_LEASE_TTL_MS",
    "DeadLettered",
    "RetryScheduled",
    "decide_failure",
    "decide_transition",
    "default_retry_delay",
    "lease_ttl",
    "load",
    "retry_delay",
]
