"""What the storage suite exercises, and the few steps its tests share.

Every test of tests/storage names the operations of the storage port it exercises with
`@covers("Backend.claim_candidate", ...)`. The names are checked when the module is imported
(a name the port does not have is an error at once), and test_coverage.py fails when an
operation of the port (a public method of `Backend`, a member of the `Database` or `Notifier`
protocol) is named by no test. So an operation added to a backend without a conformance test,
or a test left behind by a rename, fails the suite.

The shared steps below write through the port only (`Backend` methods inside units of work),
as the service does, never through the service itself.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from nulltickets.domain.ids import new_id
from nulltickets.domain.model import Task
from nulltickets.storage.backend import Backend, NewTask
from nulltickets.storage.ports import Database, Notifier

F = TypeVar("F", bound=Callable[..., Any])

NOW = 1_000_000  # the tests' clock: time is a parameter of every statement


def port_operations() -> set[str]:
    """Every operation of the storage port, as `Class.name`."""
    names = {f"Backend.{n}" for n, v in vars(Backend).items() if _public(n) and callable(v)}
    for protocol in (Database, Notifier):
        names |= {
            f"{protocol.__name__}.{n}"
            for n, v in vars(protocol).items()
            if _public(n) and (callable(v) or isinstance(v, property))
        }
    return names


def _public(name: str) -> bool:
    return not name.startswith("_")


# operation -> the tests (module:function) that name it
COVERED: dict[str, set[str]] = {}
_KNOWN = port_operations()


def covers(*operations: str) -> Callable[[F], F]:
    """Mark a test as exercising `operations` (each `Backend.x`, `Database.x` or `Notifier.x`)."""
    unknown = sorted(set(operations) - _KNOWN)
    if unknown:
        raise AssertionError(f"not operations of the storage port: {unknown}")

    def mark(test: F) -> F:
        where = f"{inspect.getmodule(test).__name__}:{test.__name__}"  # type: ignore[union-attr]
        for name in operations:
            COVERED.setdefault(name, set()).add(where)
        return test

    return mark


# --- shared steps, through the port --------------------------------------------------------------


def make_pipeline(
    b: Backend,
    role: str = "coder",
    *,
    name: str | None = None,
    stages: tuple[tuple[str, str | None, bool], ...] | None = None,
    now: int = NOW,
) -> str:
    """A pipeline todo (worked by `role`) -> review (`reviewer`) -> done, dead (terminal)."""
    pipeline_id = new_id()
    b.insert_pipeline(pipeline_id, name or f"p-{pipeline_id}", "{}", now)
    if stages is None:
        stages = (
            ("todo", role, False),
            ("review", "reviewer", False),
            ("done", None, True),
            ("dead", None, True),
        )
    for stage, agent_role, terminal in stages:
        b.insert_pipeline_stage(pipeline_id, stage, agent_role, terminal)
    return pipeline_id


def make_task(
    b: Backend,
    pipeline_id: str,
    *,
    title: str = "t",
    stage: str = "todo",
    priority: int = 0,
    now: int = NOW,
    idempotency_key: str | None = None,
    max_attempts: int | None = None,
    retry_delay_ms: int = 0,
    retry_delay_set: bool = False,
    dead_letter_stage: str | None = None,
    metadata_json: str = "{}",
    description: str = "",
) -> str:
    task_id = new_id()
    inserted = b.insert_task(
        NewTask(
            id=task_id,
            pipeline_id=pipeline_id,
            stage=stage,
            title=title,
            description=description,
            priority=priority,
            metadata_json=metadata_json,
            max_attempts=max_attempts,
            retry_delay_ms=retry_delay_ms,
            dead_letter_stage=dead_letter_stage,
            idempotency_key=idempotency_key,
            retry_delay_set=retry_delay_set,
            now=now,
        )
    )
    assert inserted
    return task_id


@dataclass(frozen=True)
class Claimed:
    """A claim made through the port: the task, its run, its lease."""

    task: Task
    run_id: str
    lease_id: str
    attempt: int
    fence: int
    checkpoint: str | None
    token_hash: bytes
    expires_at_ms: int


def claim(
    b: Backend,
    role: str = "coder",
    agent: str = "agent",
    *,
    now: int = NOW,
    ttl: int = 60_000,
    full_stages: tuple[str, ...] = (),
    full_pairs: tuple[tuple[str, str], ...] = (),
) -> Claimed | None:
    """One claim as the service makes it: choose, start a run, raise the fence, lease."""
    task = b.claim_candidate(role, agent, now, full_stages, full_pairs)
    if task is None:
        return None
    run_id, lease_id = new_id(), new_id()
    attempt = b.insert_run(run_id, task.id, agent, role, now, lease_id)  # StorageBusy: a race
    fence, checkpoint = b.bump_fence(task.id)
    token_hash = new_id().encode().ljust(32, b"-")[:32]
    b.insert_lease(
        id=lease_id,
        run_id=run_id,
        agent_id=agent,
        token_hash=token_hash,
        expires_at_ms=now + ttl,
        ttl_ms=ttl,
        fence=fence,
        now=now,
    )
    return Claimed(task, run_id, lease_id, attempt, fence, checkpoint, token_hash, now + ttl)


def claimed(b: Backend, role: str = "coder", agent: str = "agent", **kw: Any) -> Claimed:
    found = claim(b, role, agent, **kw)
    assert found is not None
    return found
