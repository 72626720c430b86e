from __future__ import annotations

import copy
from typing import Any

import pytest

from nulltickets.domain.fsm import load_definition, parse_definition
from nulltickets.errors import InvalidPipeline
from tests.server import PIPELINE


def definition(**changes: Any) -> dict[str, Any]:
    d = copy.deepcopy(PIPELINE)
    d.update(changes)
    return d


def test_valid_definition_parses_states_and_transitions_in_order() -> None:
    p = parse_definition(definition())
    assert p.initial == "todo"
    assert p.states["todo"].agent_role == "coder"
    assert p.is_terminal("done") and not p.is_terminal("todo") and not p.is_terminal("nope")
    assert [t.trigger for t in p.transitions_from("review")] == ["approve", "reject"]
    assert p.transitions_from("todo")[0].required_gates == ("tests",)


def test_first_matching_transition_wins() -> None:
    d = definition()
    d["transitions"].append({"from": "review", "to": "dead", "trigger": "approve"})
    p = parse_definition(d)
    found = p.find_transition("review", "approve")
    assert found is not None and found.to_stage == "done"
    assert p.find_transition("review", "missing") is None


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ([], "\\$ must be an object"),  # V1
        (definition(initial=3), "initial must be a string"),  # V1
        (definition(states=[]), "states must be an object"),  # V1
        (definition(transitions={}), "transitions must be an array"),  # V1
        ({**definition(), "states": {"todo": {"terminal": "yes"}}}, "terminal"),  # V1
        ({**definition(), "transitions": [{"from": "todo", "to": "done"}]}, "trigger"),  # V1
        (
            {
                **definition(),
                "transitions": [
                    {"from": "todo", "to": "done", "trigger": "t", "required_gates": [1]}
                ],
            },
            "required_gates",
        ),  # V1
        (definition(initial=""), "initial must not be empty"),  # V2
        (definition(states={}), "states must not be empty"),  # V3
        (definition(transitions=[]), "transitions must not be empty"),  # V4
        (definition(initial="nowhere"), "is not a state"),  # V5
        (
            definition(transitions=[{"from": "x", "to": "done", "trigger": "t"}]),
            "from 'x' is not a state",
        ),  # V6
        (
            definition(transitions=[{"from": "todo", "to": "y", "trigger": "t"}]),
            "to 'y' is not a state",
        ),  # V6
        (
            definition(
                states={"todo": {}, "done": {}},
                transitions=[{"from": "todo", "to": "done", "trigger": "t"}],
            ),
            "no state has terminal",
        ),  # V7
        (
            definition(
                states={"todo": {}, "mid": {}, "done": {"terminal": True}},
                transitions=[{"from": "todo", "to": "done", "trigger": "t"}],
            ),
            "'mid' has no outgoing",
        ),  # V8
    ],
)
def test_invalid_definitions_name_the_first_rule_they_break(bad: Any, reason: str) -> None:
    with pytest.raises(InvalidPipeline, match=reason) as info:
        parse_definition(bad)
    assert info.value.code == "validation_failed"


def test_unknown_keys_and_unused_fields_are_accepted() -> None:
    d = definition(extra={"x": 1})
    d["states"]["todo"]["workflow_id"] = "wf"
    d["states"]["todo"]["description"] = "first"
    assert parse_definition(d).initial == "todo"


def test_stored_definitions_load_leniently_even_when_no_longer_valid() -> None:
    loose = definition(transitions=[])
    assert load_definition(loose) is not None
    assert load_definition("not a definition") is None
