"""Pipeline definitions: the finite-state machine each task moves through.

`parse_definition` validates a submitted definition (checks V1-V8 of the contract, first failure
wins) and returns an immutable `Pipeline` that claim, transition and fail consult.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from difflib import get_close_matches
from typing import Any

from nulltickets.domain.commands import MAX_RETRY_DELAY_MS
from nulltickets.errors import InvalidPipeline


@dataclass(frozen=True, slots=True)
class StagePolicy:
    """Optional per-stage settings of a definition (keys of a state object). A task's own
    retry policy and a claim's own lease TTL win over them."""

    lease_ttl_ms: int | None = None
    retry_delay_ms: int | None = None
    retry_backoff: float = 1.0  # each failure multiplies the delay by this
    retry_max_delay_ms: int | None = None
    retry_jitter: float = 0.0  # +/- this fraction of the delay, at random
    max_concurrency: int | None = None  # leased tasks of this pipeline in this stage at once


NO_POLICY = StagePolicy()


@dataclass(frozen=True, slots=True)
class State:
    name: str
    agent_role: str | None = None
    terminal: bool = False
    policy: StagePolicy = NO_POLICY


@dataclass(frozen=True, slots=True)
class Transition:
    from_stage: str
    to_stage: str
    trigger: str
    instructions: str | None = None
    required_gates: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Pipeline:
    """A validated definition. Pipelines are immutable once created, so these are cached."""

    initial: str
    states: dict[str, State]
    transitions: tuple[Transition, ...]
    _by_stage: dict[str, tuple[Transition, ...]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        by_stage: dict[str, list[Transition]] = {}
        for t in self.transitions:
            by_stage.setdefault(t.from_stage, []).append(t)
        self._by_stage.update({k: tuple(v) for k, v in by_stage.items()})

    def transitions_from(self, stage: str) -> tuple[Transition, ...]:
        """Transitions leaving `stage`, in definition order."""
        return self._by_stage.get(stage, ())

    def find_transition(self, stage: str, trigger: str) -> Transition | None:
        """The first transition (definition order) leaving `stage` on `trigger`."""
        for t in self._by_stage.get(stage, ()):
            if t.trigger == trigger:
                return t
        return None

    def policy(self, stage: str) -> StagePolicy:
        state = self.states.get(stage)
        return state.policy if state is not None else NO_POLICY

    def is_terminal(self, stage: str) -> bool:
        state = self.states.get(stage)
        return state is not None and state.terminal


def _fail(reason: str) -> InvalidPipeline:
    return InvalidPipeline(f"invalid pipeline definition: {reason}")


def _optional(obj: dict[str, Any], key: str, kind: type, path: str) -> Any:
    value = obj.get(key)
    if value is None:
        return None
    if kind is str and not isinstance(value, str):
        raise _fail(f"{path}.{key} must be a string")
    if kind is bool and not isinstance(value, bool):
        raise _fail(f"{path}.{key} must be a boolean")
    return value


def _number(
    obj: dict[str, Any],
    key: str,
    path: str,
    *,
    low: float,
    high: float | None = None,
    integer: bool = True,
) -> Any:
    value = obj.get(key)
    if value is None:
        return None
    kind = "an integer" if integer else "a number"
    ok_type = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok_type:
        raise _fail(f"{path}.{key} must be {kind}")
    if value < low or (high is not None and value > high) or value != value:
        bounds = f">= {low}" if high is None else f"between {low} and {high}"
        raise _fail(f"{path}.{key} must be {bounds}")
    return value


# A state object's own keys (the contract's) and its policy keys. Other keys are kept and
# ignored, as the contract says, except those that look like a policy key: a misspelled one
# would otherwise be ignored silently, and the stage would run without the policy it asked for.
_STATE_KEYS = frozenset(("agent_role", "terminal", "description", "workflow_id"))
_POLICY_KEYS = (
    "lease_ttl_ms",
    "retry_delay_ms",
    "retry_backoff",
    "retry_max_delay_ms",
    "retry_jitter",
    "max_concurrency",
)
_TASK_POLICY_KEYS = frozenset(("retry_policy", "max_attempts", "dead_letter_stage"))
_POLICY_PREFIXES = ("retry", "lease")


def _unknown_policy_key(raw: dict[str, Any], path: str) -> None:
    for key in raw:
        if key in _STATE_KEYS or key in _POLICY_KEYS:
            continue
        known = ", ".join(_POLICY_KEYS)
        if key in _TASK_POLICY_KEYS:
            raise _fail(
                f"{path}.{key} is not a stage policy key: max_attempts and dead_letter_stage "
                f"belong in a task's retry_policy (a stage takes {known})"
            )
        lowered = key.lower()
        if lowered.startswith(_POLICY_PREFIXES) or get_close_matches(
            lowered, _POLICY_KEYS, n=1, cutoff=0.8
        ):
            raise _fail(f"{path}.{key} is not a stage policy key (a stage takes {known})")


def _policy(raw: dict[str, Any], path: str) -> StagePolicy:
    day = 86_400_000
    policy = StagePolicy(
        lease_ttl_ms=_number(raw, "lease_ttl_ms", path, low=1, high=day),
        retry_delay_ms=_number(raw, "retry_delay_ms", path, low=0, high=MAX_RETRY_DELAY_MS),
        retry_backoff=_number(raw, "retry_backoff", path, low=1, high=100, integer=False) or 1.0,
        retry_max_delay_ms=_number(raw, "retry_max_delay_ms", path, low=0, high=MAX_RETRY_DELAY_MS),
        retry_jitter=_number(raw, "retry_jitter", path, low=0, high=1, integer=False) or 0.0,
        max_concurrency=_number(raw, "max_concurrency", path, low=1, high=1_000_000),
    )
    return NO_POLICY if policy == NO_POLICY else policy


def _required_str(obj: dict[str, Any], key: str, path: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        raise _fail(f"{path}.{key} must be a string")
    return value


def _shape(definition: Any) -> Pipeline:
    """Check V1: the shape and types of every known key."""
    if not isinstance(definition, dict):
        raise _fail("$ must be an object")
    initial = _required_str(definition, "initial", "$")
    raw_states = definition.get("states")
    if not isinstance(raw_states, dict):
        raise _fail("$.states must be an object")
    raw_transitions = definition.get("transitions")
    if not isinstance(raw_transitions, list):
        raise _fail("$.transitions must be an array")

    states: dict[str, State] = {}
    for name, raw in raw_states.items():
        path = f"$.states.{name}"
        if not isinstance(raw, dict):
            raise _fail(f"{path} must be an object")
        _optional(raw, "description", str, path)
        _optional(raw, "workflow_id", str, path)
        states[name] = State(
            name=name,
            agent_role=_optional(raw, "agent_role", str, path),
            terminal=_optional(raw, "terminal", bool, path) is True,
            policy=_policy(raw, path),
        )

    transitions: list[Transition] = []
    for i, raw in enumerate(raw_transitions):
        path = f"$.transitions[{i}]"
        if not isinstance(raw, dict):
            raise _fail(f"{path} must be an object")
        gates = raw.get("required_gates")
        if gates is None:
            gates = []
        if not isinstance(gates, list) or not all(isinstance(g, str) for g in gates):
            raise _fail(f"{path}.required_gates must be an array of strings")
        transitions.append(
            Transition(
                from_stage=_required_str(raw, "from", path),
                to_stage=_required_str(raw, "to", path),
                trigger=_required_str(raw, "trigger", path),
                instructions=_optional(raw, "instructions", str, path),
                required_gates=tuple(gates),
            )
        )
    return Pipeline(initial=initial, states=states, transitions=tuple(transitions))


def parse_definition(definition: Any) -> Pipeline:
    """Validate a pipeline definition; raise InvalidPipeline naming the first failed rule."""
    pipeline = _shape(definition)
    # Only new definitions: a stored one (load_definition) keeps working whatever it holds.
    for name, raw in definition["states"].items():
        _unknown_policy_key(raw, f"$.states.{name}")
    if pipeline.initial == "":
        raise _fail("$.initial must not be empty")
    if not pipeline.states:
        raise _fail("$.states must not be empty")
    if not pipeline.transitions:
        raise _fail("$.transitions must not be empty")
    if pipeline.initial not in pipeline.states:
        raise _fail(f"$.initial {pipeline.initial!r} is not a state")
    for i, t in enumerate(pipeline.transitions):
        if t.from_stage not in pipeline.states:
            raise _fail(f"$.transitions[{i}].from {t.from_stage!r} is not a state")
        if t.to_stage not in pipeline.states:
            raise _fail(f"$.transitions[{i}].to {t.to_stage!r} is not a state")
    if not any(s.terminal for s in pipeline.states.values()):
        raise _fail("no state has terminal: true")
    for state in pipeline.states.values():
        if not state.terminal and not pipeline.transitions_from(state.name):
            raise _fail(f"non-terminal state {state.name!r} has no outgoing transition")
    return pipeline


def load_definition(definition: Any) -> Pipeline | None:
    """Read a stored definition leniently (a database may hold ones we would now reject)."""
    try:
        return _shape(definition)
    except InvalidPipeline:
        return None
