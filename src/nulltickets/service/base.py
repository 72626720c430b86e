"""What every area of the tracker shares: its caches and notifier (`TrackerBase`), the
constants and the small helpers of paging and bulk verbs."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from nulltickets.domain import fsm
from nulltickets.domain.clock import Random, system_random
from nulltickets.domain.commands import (
    MAX_BULK_IDS,
)
from nulltickets.domain.model import (
    AvailableTransition,
    BulkOutcome,
    OutcomeError,
    Task,
    TaskDetails,
    TaskOutcome,
)
from nulltickets.errors import (
    InvalidRequest,
    InvalidStage,
    TaskFinished,
    TaskLeased,
    TaskNotFound,
)
from nulltickets.storage.backend import Backend, StagePolicyRow
from nulltickets.storage.ports import Notifier

RESERVED_NAMESPACE = "search"
IDEMPOTENCY_RETENTION_MS = 24 * 3600 * 1000
# The dashboard's throughput looks at this many of the newest run events at most.
THROUGHPUT_WINDOW = 200_000
REAP_BATCH = 500
_NEVER = 2**63 - 1
# With several servers on one database, another server's claims may create leases that expire
# before the earliest one this process knows of: then `_next_expiry` is trusted for at most
# this long (claims reap at least once per horizon; the janitor reaps on its own timer).
SHARED_REAP_HORIZON_MS = 1000

_encode = msgspec.json.encode

T = TypeVar("T")


def _parse(definition: msgspec.Raw) -> fsm.Pipeline | None:
    """A stored definition, parsed; None if it cannot be."""
    try:
        return fsm.load_definition(msgspec.json.decode(definition))
    except msgspec.DecodeError:
        return None


def _json(value: Any) -> str:
    return _encode(value).decode()


class TrackerBase:
    """The rules of every verb, inside one unit of work (a `Backend` and its time).

    Caches, and why each is safe with several processes on one database: parsed pipeline
    definitions and their transitions (a definition never changes once created); each role's
    capped stages (`_capped`, rebuilt when a claim meets a pipeline it was not built with);
    and `_next_expiry`, a lower bound of the live leases' expiry that lets claims skip the
    reaper (this process's claims lower it; on a database shared by servers it is trusted for
    SHARED_REAP_HORIZON_MS at most). A cache a rolled-back batch leaves too low costs one
    extra reap; none can make a decision wrong, since every transition is guarded in the data.
    """

    def __init__(
        self,
        notifier: Notifier | None = None,
        rand: Random = system_random,
        *,
        shared: bool = False,
        keys_enabled: bool = True,
    ) -> None:
        self.keys_enabled = keys_enabled  # keys need an admin token on the server
        self._notifier = notifier
        self._rand = rand
        self._shared = shared
        self._pipelines: dict[str, fsm.Pipeline | None] = {}
        self._transitions: dict[tuple[str, str], list[AvailableTransition]] = {}
        # Per trigger: how many pipelines had been read when its moves were found, and
        # (pipeline, from stage, to stage, the transition's instructions, whether the stage it
        # leaves caps its leases) of each.
        self._by_trigger: dict[str, tuple[int, list[tuple[str, str, str, str | None, bool]]]] = {}
        # What Leases._stage_policies sends with a failure: how many pipelines had been read,
        # those whose definition could not be parsed, and the others' stage retry policies.
        self._policies: tuple[int, list[str], list[StagePolicyRow]] | None = None
        self._lock = threading.Lock()
        self._next_expiry = 0  # 0: unknown
        # Per role: the pipelines it was built from, (pipeline, stage, max_concurrency) of the
        # stages with a limit, and (pipeline, stage, lease_ttl_ms) of those with a lease TTL.
        self._capped: dict[
            str,
            tuple[frozenset[str], list[tuple[str, str, int]], list[tuple[str, str, int]]],
        ] = {}

    if TYPE_CHECKING:  # what one area asks of another (Tracker has them all)

        def reap_expired(self, b: Backend, now: int) -> int: ...

        def get_task(self, b: Backend, task_id: str) -> TaskDetails: ...

        def _available(self, b: Backend, task: Task) -> list[AvailableTransition]: ...

    @property
    def _listening(self) -> bool:
        return self._notifier is not None and self._notifier.listening

    def _signal(
        self, b: Backend, pipeline_id: str, stage: str, at: int = 0, agent: str | None = None
    ) -> None:
        """One piece of work in the stage may be claimable at `at` (0: now), by `agent` only
        when given: it wakes one waiting claim of the stage's role (service/wakeups.py)."""
        notifier = self._notifier
        if notifier is None or (at == 0 and not notifier.listening):
            return
        pipeline = self._definition(b, pipeline_id)
        state = pipeline.states.get(stage) if pipeline is not None else None
        if state is not None and state.agent_role is not None:
            notifier.notify(b, state.agent_role, at, agent)

    # --- pipelines -----------------------------------------------------------------------------

    def _read_every_pipeline(self, b: Backend) -> None:
        """Parse every pipeline's definition this process has not read yet."""
        for row in b.list_pipelines():
            if row.id not in self._pipelines:
                parsed = _parse(row.definition)
                with self._lock:
                    self._pipelines.setdefault(row.id, parsed)

    def _definition(self, b: Backend, pipeline_id: str) -> fsm.Pipeline | None:
        """Parsed definition of an existing pipeline; None if it is unknown or unparsable."""
        cached = self._pipelines.get(pipeline_id, False)
        if cached is not False:
            return cached  # type: ignore[return-value]
        row = b.get_pipeline(pipeline_id)
        if row is None:
            return None
        parsed = _parse(row.definition)
        with self._lock:
            self._pipelines[pipeline_id] = parsed
        return parsed


# The kinds GET /ops/failures lists, by the names its `kind` takes, and the state each is.
FAILURE_KINDS = {
    "dead": "dead_lettered",
    "dead_lettered": "dead_lettered",
    "cancelled": "cancelled",
    "failing": "failing",
}
# What one task of a bulk verb may be refused for; anything else fails the whole request.
BULK_REFUSALS = (TaskNotFound, TaskLeased, TaskFinished, InvalidStage)


def failure_states(kind: str | None) -> frozenset[str]:
    """The states a `kind` of GET /ops/failures names: a comma-separated list of dead,
    cancelled and failing (absent or empty: all three)."""
    if not kind:
        return frozenset(FAILURE_KINDS.values())
    states = set()
    for name in kind.split(","):
        state = FAILURE_KINDS.get(name.strip())
        if state is None:
            raise InvalidRequest(
                "kind must be dead, cancelled or failing, or a comma-separated list of them"
            )
        states.add(state)
    return frozenset(states)


def _bulk(ids: list[str], act: Callable[[str], TaskOutcome]) -> BulkOutcome:
    """Run `act` once for each id, in the order of the ids (so that two bulk verbs on one
    PostgreSQL lock their tasks in one order), and answer in the order given. A refusal is
    that id's outcome, not the request's."""
    if not ids:
        raise InvalidRequest("ids must not be empty")
    if len(ids) > MAX_BULK_IDS:
        raise InvalidRequest(f"ids may hold at most {MAX_BULK_IDS} task ids")
    done: dict[str, TaskOutcome] = {}
    for task_id in sorted(set(ids)):
        try:
            done[task_id] = act(task_id)
        except BULK_REFUSALS as exc:
            error = OutcomeError(exc.code, exc.message)
            done[task_id] = TaskOutcome(task_id, "refused", None, error)
    items = [done[task_id] for task_id in ids]
    changed = sum(1 for o in done.values() if o.outcome in ("requeued", "cancelled"))
    refused = sum(1 for o in done.values() if o.outcome == "refused")
    return BulkOutcome(items, changed, refused)


def _clamp(t: int) -> int:
    return max(-(2**63), min(t, 2**63 - 1))


def _page(rows: list[Any], limit: int, cursor_of: Any) -> tuple[list[Any], str | None]:
    """Trim the look-ahead row; the cursor names the last row returned, so nothing is skipped."""
    if len(rows) > limit:
        rows = rows[:limit]
        return rows, cursor_of(rows[-1])
    return rows, None


# --- the unit of work --------------------------------------------------------------------------
