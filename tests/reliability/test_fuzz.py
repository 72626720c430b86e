"""Suite 4, fuzzing from the contract: schemathesis generates requests for every operation of our
own /openapi.json (schema-valid and schema-invalid, with and without the admin token, on random
and on real ids and lease tokens); every answer must be below 500, use the error envelope when it
is an error, carry a documented status and match its schema. Hypothesis property tests cover the
pipeline validator (in-process and against the server) and the store's search-query sanitiser.

`make test` runs a bounded, derandomized number of examples; `make soak` many more, at random."""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import apsw
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.specs.openapi import checks as openapi_checks

from nulltickets.domain.fsm import parse_definition
from nulltickets.domain.search import search_terms
from nulltickets.errors import InvalidPipeline
from nulltickets.http.openapi import OPENAPI_ROUTES
from nulltickets.http.routes import ROUTES
from nulltickets.service.verbs import Guard as Auth
from nulltickets.storage.sqlite.search import fts_query
from tests.reliability.report import Recorder, scale, soak
from tests.server import PIPELINE, Client, Server

pytestmark = pytest.mark.e2e

TOKEN = "fuzz-admin-token"
EXAMPLES = scale(12, 250)
PROPERTY_EXAMPLES = scale(300, 5000)
HTTP_PROPERTY_EXAMPLES = scale(60, 1000)
LONG_POLL_MS = 200
REQUEST_TIMEOUT_S = 30


def fuzz_settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=not soak(),  # make test: the same examples every run, so no flaky finds
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )


# --- schemathesis ------------------------------------------------------------------------------


def envelope_check(ctx: Any, response: Any, case: Any) -> bool | None:
    """Every error is {"error": {"code", "message"}} (contract 1.6)."""
    if response.status_code < 400:
        return None
    try:
        doc = json.loads(response.content)
    except ValueError:
        raise AssertionError(
            f"{response.status_code} body is not JSON: {response.content[:200]!r}"
        ) from None
    error = doc.get("error") if isinstance(doc, dict) else None
    ok = (
        isinstance(error, dict)
        and list(doc) == ["error"]
        and isinstance(error.get("code"), str)
        and isinstance(error.get("message"), str)
    )
    assert ok, f"{response.status_code} body is not the error envelope: {doc!r}"
    return True


CHECKS = [
    not_a_server_error,
    openapi_checks.status_code_conformance,
    openapi_checks.content_type_conformance,
    openapi_checks.response_headers_conformance,
    openapi_checks.response_schema_conformance,
]


@dataclass
class KnownBug:
    name: str
    matches: Callable[[Any, Any], bool]
    seen: int = 0


# Server bugs with a strict-xfail regression test of their own; the fuzzer counts them instead of
# failing on them, so it keeps looking for new ones. Remove an entry with its xfail mark.
KNOWN_BUGS: list[KnownBug] = []


@dataclass
class Seeds:
    """Real ids and lease tokens, so generated requests reach past the 404s and 401s."""

    ids: dict[str, list[str]] = field(default_factory=dict)
    leases: list[dict[str, str]] = field(default_factory=list)


def seed_server(client: Client, admin: dict[str, str]) -> Seeds:
    seeds = Seeds()
    name = f"fuzz-{uuid.uuid4().hex[:8]}"
    r = client.post("/pipelines", {"name": name, "definition": PIPELINE}, headers=admin)
    assert r.status == 201, r.body
    pipeline_id = r.json["id"]
    tasks = [{"pipeline_id": pipeline_id, "title": f"t{i}", "description": "d"} for i in range(40)]
    r = client.post("/tasks/bulk", {"tasks": tasks}, headers=admin)
    assert r.status == 201, r.body
    task_ids = r.json["ids"]
    for _ in range(20):
        c = client.post("/leases/claim", {"agent_id": "fuzz", "agent_role": "coder"}, headers=admin)
        assert c.status == 200, c.body
        seeds.leases.append(
            {
                "run": c.json["run"]["id"],
                "lease": c.json["lease_id"],
                "token": c.json["lease_token"],
            }
        )
        e = client.post(
            f"/runs/{c.json['run']['id']}/events",
            {"kind": "k", "data": {"x": 1}},
            token=c.json["lease_token"],
        )
        assert e.status == 201, e.body
    for i in range(5):
        client.put(f"/store/fuzz/key{i}", {"value": {"text": f"hello world {i}"}}, headers=admin)
    seeds.ids = {
        "pipeline": [pipeline_id],
        "task": task_ids,
        "run": [x["run"] for x in seeds.leases],
        "lease": [x["lease"] for x in seeds.leases],
        "namespace": ["fuzz"],
        "key": [f"key{i}" for i in range(5)],
    }
    return seeds


def real_value(path: str, name: str, seeds: Seeds) -> list[str]:
    if name == "namespace":
        return seeds.ids["namespace"]
    if name == "key":
        return seeds.ids["key"]
    if name == "agent_id":
        return ["fuzz"]
    kind = path.strip("/").split("/")[0].rstrip("s")  # /tasks/{id} -> task, /runs/{id} -> run
    return seeds.ids.get({"leas": "lease"}.get(kind, kind), [])


@dataclass
class FuzzRun:
    statuses: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    cases: int = 0
    operations: int = 0
    admin_answers: Counter[int] = field(default_factory=Counter)  # on admin-gated operations


def gate_of(operation: Any) -> Auth:
    """How the route table says the admin gate treats this operation."""
    for route in ROUTES + OPENAPI_ROUTES:
        if route.method == operation.method.upper() and route.pattern.replace("+}", "}") == (
            operation.path
        ):
            return route.auth
    raise AssertionError(f"{operation.label} is in /openapi.json but not in the route table")


# Answers that never end by design (Server-Sent Events): a request-and-answer fuzzer can only
# time out on them. tests/e2e/test_event_stream.py covers their inputs and errors instead.
STREAMS = {"/events/stream"}


def fuzz(base: str, seeds: Seeds, admin_token: str | None, run: FuzzRun, examples: int) -> None:
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result
        operation = result.ok()
        if operation.path in STREAMS:
            continue
        run.operations += 1
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            # Unsatisfiable: nothing to make invalid (no parameters, no body).
            with contextlib.suppress(Unsatisfiable):
                fuzz_operation(operation, mode, base, seeds, admin_token, run, examples)


def fuzz_operation(
    operation: Any,
    mode: GenerationMode,
    base: str,
    seeds: Seeds,
    admin_token: str | None,
    run: FuzzRun,
    examples: int,
) -> None:
    secured = gate_of(operation) is Auth.LEASE  # a lease token opens it
    admin_gated = gate_of(operation) is Auth.KEY

    @given(case=operation.as_strategy(generation_mode=mode), data=st.data())
    @fuzz_settings(examples)
    def one(case: Any, data: st.DataObject) -> None:
        headers: dict[str, str] = {}
        lease: dict[str, str] | None = None
        if seeds.leases and data.draw(st.booleans(), label="real lease"):  # type: ignore[arg-type]
            lease = data.draw(st.sampled_from(seeds.leases), label="lease")
        for name in list(case.path_parameters or {}):
            real = real_value(operation.path, name, seeds)
            if real and data.draw(st.booleans(), label=f"real {name}"):  # type: ignore[arg-type]
                value = data.draw(st.sampled_from(real), label=name)
                if lease is not None and name == "id" and secured:
                    value = lease["lease" if "leases" in operation.path else "run"]
                case.path_parameters[name] = value
        if secured and lease is not None:
            headers["Authorization"] = f"Bearer {lease['token']}"
        elif admin_token is not None:
            headers["Authorization"] = f"Bearer {admin_token}"
        body = case.body
        if isinstance(body, dict) and isinstance(body.get("wait_ms"), int | float):
            # A long-poll claim waits as long as asked (up to its cap) when no task comes, as it
            # should; the fuzzer keeps the wait short instead of timing out on it.
            body["wait_ms"] = min(body["wait_ms"], LONG_POLL_MS)
        try:
            response = case.call(base_url=base, headers=headers, timeout=REQUEST_TIMEOUT_S)
        except requests.RequestException as exc:
            run.failures.append(f"{operation.label} [{mode.value}]: no answer: {exc!r}"[:1500])
            return
        run.cases += 1
        run.statuses[f"{response.status_code}"] += 1
        if admin_gated:
            run.admin_answers[response.status_code] += 1
        for bug in KNOWN_BUGS:
            if bug.matches(case, response):
                bug.seen += 1
                return
        try:
            case.validate_response(response, checks=CHECKS, additional_checks=[envelope_check])
        except (Exception, BaseExceptionGroup) as exc:  # schemathesis raises a FailureGroup
            run.failures.append(f"{operation.label} [{mode.value}]: {exc}"[:1500])

    one()


@pytest.fixture(scope="module")
def open_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(tmp_path_factory.mktemp("fuzz-open") / "fuzz.db").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def secured_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(tmp_path_factory.mktemp("fuzz-token") / "fuzz.db", token=TOKEN).start()
    yield server
    server.stop()


CONFIGS = {
    "no token configured": (False, None, EXAMPLES),
    "token configured, requests with it": (True, TOKEN, max(4, EXAMPLES // 2)),
    # Everything but the exempt and lease routes is a 401 here: a few examples show it.
    "token configured, requests without it": (True, None, max(3, EXAMPLES // 4)),
}


@pytest.mark.slow
@pytest.mark.timeout(scale(240, 3600))
@pytest.mark.parametrize("config", CONFIGS)
def test_schemathesis_finds_no_5xx_no_bare_error_and_no_schema_mismatch(
    request: pytest.FixtureRequest, config: str, record: Recorder
) -> None:
    secured, token, examples = CONFIGS[config]
    server: Server = request.getfixturevalue("secured_server" if secured else "open_server")
    row = record(
        "fuzz",
        f"schemathesis on /openapi.json, every operation, schema-valid and invalid data ({config})",
        0,
        "requests",
    )
    client = server.client()
    seeds = seed_server(client, {"Authorization": f"Bearer {TOKEN}"} if secured else {})
    client.close()
    run = FuzzRun()
    for bug in KNOWN_BUGS:
        bug.seen = 0
    fuzz(server.base, seeds, token, run, examples)
    row.tried = run.cases
    known = {b.name: b.seen for b in KNOWN_BUGS if b.seen}
    row.detail = (
        f"{run.operations} operations, up to {examples} examples each per mode; statuses "
        + ", ".join(f"{k} x{v}" for k, v in sorted(run.statuses.items()))
        + f"; {len(run.failures)} failures"
        + (f"; known bug hit {sum(known.values())} times: {'; '.join(known)}" if known else "")
    )
    row.extra.update(statuses=dict(run.statuses), known_bugs=known)
    assert server.proc is not None and server.proc.poll() is None, server.output()
    assert run.failures == [], "\n\n".join(run.failures[:5])
    assert run.admin_answers, "no admin-gated operation was fuzzed"
    if secured and token is None:
        assert set(run.admin_answers) == {401}, run.admin_answers


def test_an_idempotent_claim_with_nothing_to_claim_is_204(
    open_server: Server, record: Recorder
) -> None:
    """Found by this fuzzer (fixed since): the claim's token redaction choked on the empty body
    of a 204 and answered 500."""
    row = record("fuzz", "regression: an idempotent claim that finds no work", 2, "requests")
    client = open_server.client()
    try:
        for _ in range(2):
            r = client.post(
                "/leases/claim",
                {"agent_id": "a", "agent_role": f"nobody-{uuid.uuid4().hex}"},
                headers={"Idempotency-Key": "same-key"},
            )
            assert (r.status, r.body) == (204, b""), r.body
    finally:
        client.close()
    row.detail = "204 with an empty body, first time and replayed"


def test_reading_events_with_a_foreign_bearer_gets_a_documented_status(
    secured_server: Server, record: Recorder
) -> None:
    row = record(
        "fuzz",
        "with --token: GET /runs/{id}/events with a bearer that is not the admin token nor the "
        "run's lease (unknown run, another run's token)",
        2,
        "requests",
    )
    reader = secured_server.client()
    doc = reader.get("/openapi.json").json
    reader.close()
    documented = {int(s) for s in doc["paths"]["/runs/{id}/events"]["get"]["responses"]}
    admin = secured_server.client(TOKEN)
    seeds = seed_server(admin, {})
    admin.close()
    client = secured_server.client()
    try:
        answers = [
            client.get(f"/runs/{uuid.uuid4()}/events", token=seeds.leases[0]["token"]).status,
            client.get(
                f"/runs/{seeds.leases[1]['run']}/events", token=seeds.leases[0]["token"]
            ).status,
        ]
    finally:
        client.close()
    row.detail = f"answers {answers}, documented {sorted(documented)}"
    assert set(answers) <= documented, row.detail


# --- the pipeline validator --------------------------------------------------------------------

names = st.text(st.characters(codec="utf-8"), min_size=1, max_size=8)
json_values: st.SearchStrategy[Any] = st.deferred(
    lambda: (
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats(allow_nan=False, allow_infinity=False)  # JSON has neither
        | st.text(max_size=8)
        | st.lists(json_values, max_size=4)
        | st.dictionaries(st.text(max_size=6), json_values, max_size=4)
    )
)


@st.composite
def valid_definitions(draw: st.DrawFn) -> dict[str, Any]:
    """Definitions that pass V1-V8: some terminal state, and every other state leaves."""
    stages = draw(st.lists(names, min_size=2, max_size=6, unique=True))
    terminal = draw(st.sets(st.sampled_from(stages), min_size=1, max_size=len(stages) - 1))
    states: dict[str, Any] = {}
    for s in stages:
        state: dict[str, Any] = {}
        if s in terminal:
            state["terminal"] = True
        elif draw(st.booleans()):
            state["agent_role"] = draw(names)
        if draw(st.booleans()):
            state["description"] = draw(st.text(max_size=10))
        states[s] = state
    transitions = []
    for s in stages:
        if s not in terminal or draw(st.booleans()):
            for _ in range(draw(st.integers(1 if s not in terminal else 0, 2))):
                t: dict[str, Any] = {
                    "from": s,
                    "to": draw(st.sampled_from(stages)),
                    "trigger": draw(names),
                }
                if draw(st.booleans()):
                    t["required_gates"] = draw(st.lists(names, max_size=2))
                transitions.append(t)
    if not transitions:
        transitions.append({"from": stages[0], "to": stages[0], "trigger": "loop"})
    return {"initial": draw(st.sampled_from(stages)), "states": states, "transitions": transitions}


BREAKERS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "V2 empty initial": lambda d: d.update(initial=""),
    "V3 no states": lambda d: d.update(states={}),
    "V4 no transitions": lambda d: d.update(transitions=[]),
    "V5 initial not a state": lambda d: d.update(initial="\x00not a state"),
    "V6 transition to nowhere": lambda d: d["transitions"][0].update(to="\x00nowhere"),
    "V7 no terminal state": lambda d: [s.pop("terminal", None) for s in d["states"].values()],
    "V1 terminal not a boolean": lambda d: next(iter(d["states"].values())).update(terminal="yes"),
    "V1 a transition without trigger": lambda d: d["transitions"][0].pop("trigger"),
    "V1 states is an array": lambda d: d.update(states=list(d["states"])),
}


def test_any_json_is_accepted_or_refused_with_invalid_pipeline(record: Recorder) -> None:
    row = record(
        "fuzz",
        "hypothesis: any JSON value as a pipeline definition (FSM validator, in process)",
        0,
        "definitions",
    )
    verdicts: Counter[str] = Counter()

    @given(definition=json_values)
    @fuzz_settings(PROPERTY_EXAMPLES)
    def check(definition: Any) -> None:
        try:
            parse_definition(definition)
            verdicts["accepted"] += 1
        except InvalidPipeline as exc:
            assert exc.message.startswith("invalid pipeline definition: "), exc.message
            verdicts["InvalidPipeline"] += 1

    check()
    row.tried = sum(verdicts.values())
    row.detail = f"{dict(verdicts)}; never another exception"


def test_every_valid_definition_is_accepted_and_read_back_faithfully(record: Recorder) -> None:
    row = record(
        "fuzz",
        "hypothesis: generated valid definitions (rules V1-V8 hold) are accepted and read back "
        "faithfully (stages, terminal flags, transitions in order, first match per trigger)",
        0,
        "definitions",
    )
    count = 0

    @given(definition=valid_definitions())
    @fuzz_settings(PROPERTY_EXAMPLES)
    def check(definition: dict[str, Any]) -> None:
        nonlocal count
        count += 1
        pipeline = parse_definition(definition)
        assert pipeline.initial == definition["initial"]
        assert set(pipeline.states) == set(definition["states"])
        for stage, state in definition["states"].items():
            leaving = [t for t in definition["transitions"] if t["from"] == stage]
            got = [t.trigger for t in pipeline.transitions_from(stage)]
            assert got == [t["trigger"] for t in leaving]
            for t in leaving:
                first = next(x for x in leaving if x["trigger"] == t["trigger"])
                found = pipeline.find_transition(stage, t["trigger"])
                assert found is not None and found.to_stage == first["to"]
            assert pipeline.is_terminal(stage) == (state.get("terminal") is True)

    check()
    row.tried = count
    row.detail = "all accepted and read back as written"


def test_breaking_one_rule_of_a_valid_definition_is_refused(record: Recorder) -> None:
    row = record(
        "fuzz",
        "hypothesis: a valid definition with exactly one rule broken (V1 shapes, V2-V7) is refused",
        0,
        "definitions",
    )
    broken: Counter[str] = Counter()

    @given(definition=valid_definitions(), breaker=st.sampled_from(sorted(BREAKERS)))
    @fuzz_settings(PROPERTY_EXAMPLES)
    def check(definition: dict[str, Any], breaker: str) -> None:
        BREAKERS[breaker](definition)
        with pytest.raises(InvalidPipeline):
            parse_definition(definition)
        broken[breaker.split()[0]] += 1

    check()
    row.tried = sum(broken.values())
    row.detail = (
        "all refused with InvalidPipeline ("
        + ", ".join(f"{k} x{v}" for k, v in sorted(broken.items()))
        + ")"
    )


def verdict(definition: Any) -> bool:
    try:
        parse_definition(definition)
    except InvalidPipeline:
        return False
    return True


@pytest.mark.timeout(scale(120, 1800))
def test_the_server_agrees_with_the_validator_on_generated_definitions(
    open_server: Server, record: Recorder
) -> None:
    row = record(
        "fuzz",
        "hypothesis: generated pipeline definitions (valid, one rule broken, any JSON) posted to "
        "the server agree with the in-process FSM validator",
        0,
        "definitions",
    )
    client = open_server.client()
    seen: Counter[int] = Counter()
    counter = iter(range(10**9))

    @given(
        definition=st.one_of(
            valid_definitions(),
            st.tuples(valid_definitions(), st.sampled_from(sorted(BREAKERS))).map(
                lambda p: (BREAKERS[p[1]](p[0]), p[0])[1]
            ),
            json_values,
        )
    )
    @fuzz_settings(HTTP_PROPERTY_EXAMPLES)
    def check(definition: Any) -> None:
        r = client.post("/pipelines", {"name": f"gen-{next(counter)}", "definition": definition})
        seen[r.status] += 1
        assert r.status < 500, r.body
        if verdict(definition):
            assert r.status == 201, (definition, r.body)
        else:
            assert (r.status, r.error_code) == (400, "validation_failed"), (definition, r.body)

    try:
        check()
    finally:
        client.close()
    row.tried = sum(seen.values())
    row.detail = f"answers {dict(sorted(seen.items()))}; server and validator agreed every time"


# --- the search-query sanitiser ----------------------------------------------------------------

nasty_text = st.lists(
    st.one_of(
        st.characters(codec="utf-8"),
        st.sampled_from([*"\"*^:()-+{}[],.\\'", "NEAR", "AND", "OR", "NOT", "\x00", " "]),
    ),
    max_size=30,
).map("".join)


@pytest.fixture(scope="module")
def fts() -> Iterator[apsw.Connection]:
    conn = apsw.Connection(":memory:")
    conn.execute("CREATE VIRTUAL TABLE t USING fts5(namespace, key, value_json)")
    yield conn
    conn.close()


def test_any_text_becomes_a_valid_fts5_query_of_quoted_phrases(
    fts: apsw.Connection, record: Recorder
) -> None:
    row = record(
        "fuzz",
        "hypothesis: arbitrary text through the search-query sanitiser, then FTS5 MATCH "
        "(operators, quotes, NUL, any Unicode)",
        0,
        "texts",
    )
    count = 0

    @given(text=nasty_text)
    @fuzz_settings(PROPERTY_EXAMPLES)
    def check(text: str) -> None:
        nonlocal count
        count += 1
        terms = [t for t in re.split(r"[ \t\r\n\x00]+", text) if t]
        assert search_terms(text) == terms
        if not terms:
            return
        query = fts_query(terms)
        assert query == " ".join('"' + t.replace('"', '""') + '"' for t in terms)
        fts.execute("SELECT count(*) FROM t WHERE t MATCH ?", (query,)).fetchall()  # never raises

    check()
    row.tried = count
    row.detail = (
        "each term one quoted phrase, FTS5 accepted every query, no term only in blank text"
    )


def test_a_stored_word_is_found_by_searching_for_it(fts: apsw.Connection, record: Recorder) -> None:
    row = record(
        "fuzz",
        "hypothesis: a word stored amid arbitrary text is found by searching for it",
        0,
        "documents",
    )
    count = 0

    @given(
        word=st.text(
            st.characters(categories=["Ll", "Lu", "Nd"], max_codepoint=0x24F),
            min_size=1,
            max_size=12,
        ),
        around=nasty_text,
    )
    @fuzz_settings(PROPERTY_EXAMPLES)
    def check(word: str, around: str) -> None:
        nonlocal count
        count += 1
        with fts:
            fts.execute("DELETE FROM t")
            fts.execute(
                "INSERT INTO t(namespace, key, value_json) VALUES ('ns', 'k', ?)",
                (json.dumps({"text": f"{around} {word} {around}"}, ensure_ascii=False),),
            )
        query = fts_query(search_terms(word))
        hits = fts.execute("SELECT count(*) FROM t WHERE t MATCH ?", (query,)).fetchall()[0][0]
        assert hits == 1, (word, around)

    check()
    row.tried = count
    row.detail = "found every time"


@pytest.mark.timeout(scale(120, 1800))
def test_the_server_answers_any_search_text_with_results_or_invalid_query(
    open_server: Server, record: Recorder
) -> None:
    row = record(
        "fuzz",
        "hypothesis: arbitrary text (FTS5 operators, quotes, NUL, any Unicode) as "
        "GET /store/search?q=",
        0,
        "queries",
    )
    client = open_server.client()
    for i, text in enumerate(["alpha beta", 'quote " mark', "NEAR(a b) OR c*", "x:y -z ^w"]):
        assert client.put(f"/store/search-fuzz/k{i}", {"value": {"text": text}}).status == 204
    seen: Counter[int] = Counter()

    @given(text=nasty_text)
    @fuzz_settings(HTTP_PROPERTY_EXAMPLES)
    def check(text: str) -> None:
        r = client.get("/store/search?q=" + quote(text, safe=""))
        seen[r.status] += 1
        if not search_terms(text):
            assert (r.status, r.error_code) == (400, "invalid_query"), (text, r.body)
        else:
            assert r.status == 200, (text, r.body)
            assert isinstance(r.json, list)

    try:
        check()
    finally:
        client.close()
    row.tried = sum(seen.values())
    row.detail = f"answers {dict(sorted(seen.items()))}; never a 5xx"
