"""What `core.py` needs of Cython's pure-Python mode when Cython is not installed: the names it
uses for typing, all of which are no-ops when the module is interpreted."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

compiled = False
int = int
long = int
longlong = int
double = float
bint = bool


def cfunc(func: F) -> F:
    return func


ccall = cfunc
inline = cfunc


def locals(**_types: Any) -> Callable[[F], F]:
    return lambda func: func


def returns(_type: Any) -> Callable[[F], F]:
    return lambda func: func
