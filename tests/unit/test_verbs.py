"""The table of verbs: every verb has each surface it declares, and each surface comes from it.

A verb is declared once (service/verbs.py); these tests fail when a verb lacks a route, a
client method or a command it declares, when the clients' generated methods are stale, or
when a surface carries an operation the table does not know.
"""

from __future__ import annotations

import argparse
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from nulltickets import cli
from nulltickets.client import AsyncClient, Calls, Client
from nulltickets.client import generate as client_generate
from nulltickets.domain.model import Access
from nulltickets.http import handlers
from nulltickets.http.routes import ROUTES
from nulltickets.mcp import tools
from nulltickets.service import VERBS
from nulltickets.service.verbs import Guard, Surface, Verb, declared
from tests.unit.test_client import SAMPLES, _segments

ALL = list(VERBS.values())


def test_the_table_holds_every_verb_once() -> None:
    assert len(ALL) >= 50
    assert len({(v.method, v.path) for v in ALL}) == len(ALL)
    assert len({v.client_name for v in ALL}) == len(ALL)


@pytest.mark.parametrize("v", list(declared(Surface.HTTP)), ids=lambda v: v.name)
def test_an_http_verb_has_its_route(v: Verb) -> None:
    routes = [r for r in ROUTES if r.verb is v]
    assert routes, f"{v.name} has no route"
    route = routes[0]
    assert (route.method, route.pattern) == (v.method, v.path)
    if v.custom:
        assert route.handler is handlers.CUSTOM[v.name]
    else:
        assert route.handler.__name__ == v.name  # the generic handler, made for this verb


def test_every_route_of_the_api_is_a_verb_or_says_why_not() -> None:
    """Only the streams and texts of their own are routes without a verb (and the second path
    OTLP exporters use)."""
    others = {(r.method, r.pattern) for r in ROUTES if r.verb is None}
    assert others == {("GET", "/events/stream"), ("GET", "/metrics")}


@pytest.mark.parametrize("v", list(declared(Surface.CLIENT)), ids=lambda v: v.name)
def test_a_client_verb_has_its_call_and_both_methods(v: Verb) -> None:
    name = v.client_name
    assert isinstance(inspect.getattr_static(Calls, name), staticmethod), name
    assert callable(getattr(Client, name, None)), f"Client lacks {name}"
    assert inspect.iscoroutinefunction(getattr(AsyncClient, name, None)), name
    call = SAMPLES[name]
    assert call.method == v.method
    route = next(r for r in ROUTES if r.verb is v)
    assert route.match(_segments(call)) is not None, f"{name}: {call.path} is not {v.path}"


def test_every_call_of_the_clients_is_a_verb() -> None:
    calls = {n for n, f in vars(Calls).items() if isinstance(f, staticmethod)}
    verbs = {v.client_name for v in declared(Surface.CLIENT)}
    # The document and the texts that are no verb: OpenAPI, the metrics, the event stream.
    assert calls - verbs == {"openapi", "metrics"}


def test_the_clients_methods_are_generated_from_the_calls() -> None:
    """`make generate` writes methods.py; a call added without it fails here."""
    target = client_generate.TARGET
    text = client_generate.render()
    for step in (
        ["check", "--fix", "--select", "I", "--quiet", "--stdin-filename", str(target), "-"],
        ["format", "--quiet", "--stdin-filename", str(target), "-"],
    ):
        text = subprocess.run(
            [sys.executable, "-m", "ruff", *step],
            input=text,
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parents[2],
        ).stdout
    assert text == target.read_text(), "methods.py is stale: run make generate"


def _commands(parser: argparse.ArgumentParser, prefix: str = "") -> set[str]:
    found: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                full = f"{prefix} {name}".strip()
                found.add(full)
                found |= _commands(sub, full)
    return found


@pytest.mark.parametrize("v", list(declared(Surface.CLI)), ids=lambda v: v.name)
def test_a_cli_verb_has_its_command(v: Verb) -> None:
    assert v.cli in _commands(cli._parser()), f"{v.name}: no command `nulltickets {v.cli}`"


# Verbs for agents that are not tools, and why. Anything else an agent key may call, and every
# write under a lease, must be one: an agent reaches the tracker through its tools.
NOT_TOOLS = {
    "create_tasks": "many tasks at once is for programs; create_task is the tool",
    "ingest_traces": "OTLP protobuf, sent by tracing libraries, never by a model",
}


def _for_agents(v: Verb) -> bool:
    return v.needs is Access.AGENT or (v.guard is Guard.LEASE and v.write)


@pytest.mark.parametrize("v", [v for v in ALL if _for_agents(v)], ids=lambda v: v.name)
def test_a_verb_for_agents_has_its_tool(v: Verb) -> None:
    if v.name in NOT_TOOLS:
        assert v.tool is None, f"{v.name} is a tool now: take it out of NOT_TOOLS"
        return
    assert v.tool is not None, f"{v.name} is for agents and declares no MCP tool"
    assert Surface.MCP in v.surfaces
    assert v.tool.name in tools.specs()


def test_every_tool_has_a_valid_object_schema_and_a_distinct_name() -> None:
    specs = tools.specs()
    assert len(specs) == len(list(declared(Surface.MCP)))
    for spec in specs.values():
        assert re.fullmatch(r"[a-z][a-z_]{1,63}", spec.name), spec.name
        Draft202012Validator.check_schema(spec.schema)
        assert spec.schema["type"] == "object", spec.name
        assert spec.description.strip(), spec.name


def test_a_tool_on_the_lease_asks_for_no_lease_run_or_fence() -> None:
    """The session supplies them: a model never sees, nor passes on, a lease."""
    on_lease = [s for s in tools.specs().values() if s.on_lease]
    assert {s.name for s in on_lease} >= {"heartbeat", "save_checkpoint", "transition_task"}
    for spec in on_lease:
        asked = set(spec.schema["properties"])
        assert not asked & {"id", "lease_id", "run_id", "expected_fence", "lease_token"}, spec.name


def test_the_agent_loop_comes_first_and_untrusted_fields_are_named() -> None:
    names = list(tools.specs())
    assert names[: len(tools.LOOP)] == list(tools.LOOP)
    described = tools.specs()["claim_task"].description
    assert "untrusted" in described.lower() and "description" in described
    assert "untrusted" in tools.specs()["store_get"].description.lower()


def test_lease_verbs_take_the_lease_token_and_the_others_a_key_or_nothing() -> None:
    for v in ALL:
        if v.guard is Guard.LEASE:
            assert v.path.startswith(("/runs/", "/leases/")), v.name
        else:
            assert not v.path.startswith("/runs/") or v.method == "GET", v.name
