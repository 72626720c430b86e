"""The dashboard's routes over HTTP (without a browser): pages, files, the login and its
session cookie, the CSRF defence, and GET /ops/stages, which the overview draws."""

from __future__ import annotations

import asyncio
import http.client
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import pytest

from nulltickets import client as pyclient
from nulltickets.client import AsyncClient
from tests.conftest import claimed, make_task, module_server, pipeline_with_roles, unique
from tests.server import Client, Server

TOKEN = "dashboard-secret"


@pytest.fixture
def secured_server(request: pytest.FixtureRequest) -> Server:
    return module_server(request, "dash", token=TOKEN)


@pytest.fixture
def browser(secured_server: Server) -> Iterator[Client]:
    """A client that sends no bearer token, like a browser."""
    c = secured_server.client()
    yield c
    c.close()


@dataclass
class LoggedIn:
    status: int
    location: str
    content_type: str
    set_cookie: list[str]  # every Set-Cookie line

    def cookie(self, name: str) -> str:
        return next(line for line in self.set_cookie if line.startswith(name + "="))

    def value(self, name: str) -> str:
        return self.cookie(name).split(";", 1)[0].split("=", 1)[1]

    @property
    def jar(self) -> str:
        return "; ".join(line.split(";", 1)[0] for line in self.set_cookie)


def login(server: Server, token: str = TOKEN, target: str = "/ui/tasks") -> LoggedIn:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request(
            "POST",
            "/ui/login",
            body=urlencode({"token": token, "next": target}),
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
        r = conn.getresponse()
        r.read()
        return LoggedIn(
            r.status,
            r.getheader("location") or "",
            r.getheader("content-type") or "",
            r.headers.get_all("set-cookie") or [],
        )
    finally:
        conn.close()


# --- pages ---------------------------------------------------------------------------------


def test_root_redirects_to_the_dashboard(client: Client) -> None:
    r = client.get("/")
    assert r.status == 302
    assert r.headers["location"] == "/ui/"


@pytest.mark.parametrize(
    "path", ["/ui/", "/ui", "/ui/tasks", "/ui/task/x", "/ui/failures", "/ui/store"]
)
def test_every_page_is_the_html_shell(client: Client, path: str) -> None:
    r = client.get(path)
    assert r.status == 200
    assert r.headers["content-type"] == "text/html; charset=utf-8"
    assert b'<script type="module" src="/ui/static/app.js">' in r.body
    assert "script-src 'self'" in r.headers["content-security-policy"]


@pytest.mark.parametrize(
    ("name", "kind"),
    [("app.js", "text/javascript; charset=utf-8"), ("style.css", "text/css; charset=utf-8")],
)
def test_static_files_come_from_the_package_with_their_types(
    client: Client, name: str, kind: str
) -> None:
    r = client.get(f"/ui/static/{name}")
    assert r.status == 200
    assert r.headers["content-type"] == kind
    assert len(r.body) > 500


@pytest.mark.parametrize("path", ["/ui/nope", "/ui/static/nope.js", "/ui/static/../ui.py"])
def test_unknown_dashboard_paths_are_html_404s(client: Client, path: str) -> None:
    r = client.get(path)
    assert r.status == 404
    assert r.headers["content-type"].startswith("text/html")


def test_api_errors_stay_the_json_envelope(client: Client) -> None:
    r = client.get(f"/tasks/{unique('missing')}")
    assert r.status == 404
    assert r.headers["content-type"] == "application/json"
    assert r.error_code == "task_not_found"
    r = client.post("/", {})
    assert (r.status, r.error_code) == (405, "method_not_allowed")
    assert r.headers["content-type"] == "application/json"


def test_dashboard_routes_are_not_in_the_openapi_document(client: Client) -> None:
    paths = client.get("/openapi.json").json["paths"]
    assert not [p for p in paths if p == "/" or p.startswith("/ui")]
    stream = paths["/events/stream"]["get"]["responses"]["200"]["content"]
    assert list(stream) == ["text/event-stream"]
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]


# --- login and the session cookie ----------------------------------------------------------


def test_pages_load_without_a_token_but_their_data_does_not(browser: Client) -> None:
    assert browser.get("/ui/").status == 200
    assert browser.get("/ui/login").status == 200
    assert browser.get("/ops/stages").error_code == "unauthorized"


@pytest.mark.process
def test_a_wrong_token_is_refused_and_sets_no_cookie(secured_server: Server) -> None:
    r = login(secured_server, "wrong")
    assert r.status == 401
    assert r.content_type.startswith("text/html")
    assert r.set_cookie == []


@pytest.mark.process
def test_login_sets_an_httponly_strict_session_that_is_not_the_token(
    browser: Client, secured_server: Server
) -> None:
    r = login(secured_server)
    assert r.status == 303
    assert r.location == "/ui/tasks"
    session, csrf = r.cookie("nt_session"), r.cookie("nt_csrf")
    assert "HttpOnly" in session and "SameSite=Strict" in session
    assert "HttpOnly" not in csrf and "SameSite=Strict" in csrf
    assert "Secure" not in session  # plain HTTP here; over TLS the cookies are Secure
    assert not [line for line in r.set_cookie if TOKEN in line]
    jar = r.jar
    assert browser.get("/ops/stages", headers={"Cookie": jar}).status == 200
    assert browser.get("/metrics", headers={"Cookie": jar}).status == 200


@pytest.mark.process
def test_writes_with_the_cookie_need_the_csrf_token_and_the_same_origin(
    browser: Client, secured_server: Server
) -> None:
    r = login(secured_server)
    jar, csrf, session = r.jar, r.value("nt_csrf"), r.value("nt_session")
    body = {"name": unique("pipe"), "definition": _definition()}
    host = f"127.0.0.1:{secured_server.port}"
    refused = [
        ({"Cookie": jar}, 401, "unauthorized"),
        ({"Cookie": jar, "X-CSRF-Token": "0" * 64}, 401, "unauthorized"),
        # Refused before the session is even looked at.
        ({"Cookie": jar, "X-CSRF-Token": csrf, "Origin": "http://evil.example"}, 403, "forbidden"),
    ]
    for headers, status, code in refused:
        answer = browser.post("/pipelines", body, headers={**headers, "Host": host})
        assert (answer.status, answer.error_code) == (status, code), headers
    ok = {"Cookie": jar, "X-CSRF-Token": csrf, "Origin": f"http://{host}", "Host": host}
    assert browser.post("/pipelines", body, headers=ok).status == 201
    # A forged session (another token's MAC) opens nothing.
    forged = jar.replace(session, "1.deadbeef")
    assert browser.get("/ops/stages", headers={"Cookie": forged}).status == 401


@pytest.mark.process
def test_login_redirects_only_inside_the_dashboard(secured_server: Server) -> None:
    assert login(secured_server, target="https://evil.example/").location == "/ui/"
    assert login(secured_server, target="//evil.example/ui/").location == "/ui/"


def _definition() -> dict[str, Any]:
    return {
        "initial": "a",
        "states": {"a": {"agent_role": unique("r")}, "b": {"terminal": True}},
        "transitions": [{"from": "a", "to": "b", "trigger": "go"}],
    }


# --- /ops/stages ---------------------------------------------------------------------------


def test_stages_count_each_task_in_the_state_it_is_in(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    leased = make_task(client, pipeline_id, priority=9)
    retry = {"retry_delay_ms": 600_000, "max_attempts": 5}
    delayed = make_task(client, pipeline_id, priority=8, retry_policy=retry)
    make_task(client, pipeline_id)
    blocker = make_task(client, pipeline_id, priority=-1)
    waiting = make_task(client, pipeline_id)
    r = client.post(f"/tasks/{waiting}/dependencies", {"depends_on_task_id": blocker})
    assert r.status == 201, r.body
    cancelled = make_task(client, pipeline_id)
    assert client.post(f"/tasks/{cancelled}/cancel").status == 200
    lease = claimed(client, coder)
    assert lease["task"]["id"] == leased
    lease2 = claimed(client, coder)
    assert lease2["task"]["id"] == delayed
    r = client.post(
        f"/runs/{lease2['run']['id']}/fail", {"error": "x"}, token=lease2["lease_token"]
    )
    assert r.status == 200, r.body
    report = client.get("/ops/stages").json
    [todo] = [
        s for s in report["stages"] if s["pipeline_id"] == pipeline_id and s["stage"] == "todo"
    ]
    assert todo["role"] == coder
    assert (todo["claimable"], todo["leased"], todo["waiting_retry"]) == (2, 1, 1)
    assert (todo["blocked"], todo["dead_lettered"], todo["cancelled"]) == (1, 0, 1)
    assert todo["oldest_claimable_age_ms"] >= 0
    assert len(report["transitions_per_minute"]) == 60


# --- what the other pages read -------------------------------------------------------------


def test_task_runs_list_every_attempt_with_its_agent_and_error(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id, retry_policy={"max_attempts": 5})
    first = claimed(client, coder, agent="agent-one")
    r = client.post(
        f"/runs/{first['run']['id']}/fail", {"error": "boom"}, token=first["lease_token"]
    )
    assert r.status == 200, r.body
    second = claimed(client, coder, agent="agent-two")
    assert second["task"]["id"] == task_id
    runs = client.get(f"/tasks/{task_id}/runs").json
    assert runs["next_cursor"] is None
    assert [(x["attempt"], x["agent_id"], x["agent_role"]) for x in runs["items"]] == [
        (1, "agent-one", coder),
        (2, "agent-two", coder),
    ]
    assert [(x["status"], x["error"]) for x in runs["items"]] == [
        ("failed", "boom"),
        ("running", None),
    ]
    assert runs["items"][0]["id"] == first["run"]["id"]
    page = client.get(f"/tasks/{task_id}/runs?limit=1").json
    assert [x["agent_id"] for x in page["items"]] == ["agent-one"]
    rest = client.get(f"/tasks/{task_id}/runs?limit=1&cursor={page['next_cursor']}").json
    assert [x["agent_id"] for x in rest["items"]] == ["agent-two"]
    assert client.get(f"/tasks/{unique('nope')}/runs").error_code == "task_not_found"
    assert client.get(f"/tasks/{task_id}/runs?cursor=x").error_code == "invalid_cursor"


def test_task_runs_page_newest_first_on_request(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id, retry_policy={"retry_delay_ms": 0})
    for n in range(1, 5):
        lease = claimed(client, coder, agent=f"agent-{n}")
        assert (lease["task"]["id"], lease["run"]["attempt"]) == (task_id, n)
        r = client.post(
            f"/runs/{lease['run']['id']}/fail", {"error": f"e{n}"}, token=lease["lease_token"]
        )
        assert r.status == 200, r.body
    claimed(client, coder, agent="agent-5")

    def pages(query: str) -> list[list[int]]:
        found, cursor = [], None
        while True:
            url = f"/tasks/{task_id}/runs?{query}" + (f"&cursor={cursor}" if cursor else "")
            r = client.get(url)
            assert r.status == 200, r.body
            found.append([x["attempt"] for x in r.json["items"]])
            cursor = r.json["next_cursor"]
            if cursor is None:
                return found

    assert pages("order=desc&limit=2") == [[5, 4], [3, 2], [1]]
    assert pages("order=desc") == [[5, 4, 3, 2, 1]]
    assert pages("order=desc&limit=5") == [[5, 4, 3, 2, 1]]
    assert pages("order=asc&limit=3") == [[1, 2, 3], [4, 5]]
    assert pages("limit=3") == [[1, 2, 3], [4, 5]]  # the default: oldest first, as before
    newest = client.get(f"/tasks/{task_id}/runs?order=desc&limit=1").json["items"][0]
    assert (newest["agent_id"], newest["status"]) == ("agent-5", "running")
    r = client.get(f"/tasks/{task_id}/runs?order=newest")
    assert (r.status, r.error_code) == (400, "invalid_request")
    r = client.get(f"/tasks/{task_id}/runs?order=desc&cursor=x")
    assert (r.status, r.error_code) == (400, "invalid_cursor")


def test_tasks_filter_by_text_in_the_title_or_id(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    word = unique("Parser").replace("-", "")
    wanted = [make_task(client, pipeline_id, title=f"Write the {word} {i}") for i in range(3)]
    make_task(client, pipeline_id, title="something else")
    q = word.lower()

    def ids(query: str) -> tuple[list[str], str | None]:
        r = client.get("/tasks?" + query)
        assert r.status == 200, r.body
        return [t["id"] for t in r.json["items"]], r.json["next_cursor"]

    assert ids(f"q={q}")[0] == wanted
    assert ids(f"q={q}&pipeline_id={pipeline_id}&stage=todo&role={coder}")[0] == wanted
    assert ids(f"q={q}&stage=review")[0] == []
    assert ids(f"q={q}&role={unique('nobody')}")[0] == []
    assert ids(f"q={wanted[1][-10:]}")[0] == [wanted[1]]  # a piece of the id
    first, cursor = ids(f"q={q}&limit=2")
    assert first == wanted[:2] and cursor
    assert ids(f"q={q}&limit=2&cursor={cursor}") == (wanted[2:], None)


def test_retrying_lists_the_tasks_waiting_on_a_retry_delay(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    retry = {"retry_delay_ms": 600_000, "max_attempts": 5}
    delayed = make_task(client, pipeline_id, priority=5, retry_policy=retry)
    make_task(client, pipeline_id)  # claimable: not waiting
    lease = claimed(client, coder, agent="agent-r")
    assert lease["task"]["id"] == delayed
    r = client.post(
        f"/runs/{lease['run']['id']}/fail", {"error": "rate limited"}, token=lease["lease_token"]
    )
    assert r.status == 200, r.body
    report = client.get("/ops/retrying").json
    [item] = [x for x in report["items"] if x["pipeline_id"] == pipeline_id]
    assert (item["task_id"], item["stage"], item["attempt"]) == (delayed, "todo", 1)
    assert (item["status"], item["error"]) == ("failed", "rate limited")
    assert item["next_eligible_at_ms"] > report["generated_at_ms"]
    assert item["failed_at_ms"] <= report["generated_at_ms"]
    assert client.get("/ops/retrying?limit=0").error_code == "invalid_limit"
    assert client.post(f"/tasks/{delayed}/requeue", {}).status == 200
    report = client.get("/ops/retrying").json
    assert [x for x in report["items"] if x["task_id"] == delayed] == []


def failing_task(client: Client, failures: int, **policy: Any) -> tuple[str, str, str]:
    """A task of a pipeline of its own that failed `failures` times; (pipeline, task, role)."""
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id, retry_policy={"retry_delay_ms": 0, **policy})
    for n in range(1, failures + 1):
        lease = claimed(client, coder)
        r = client.post(
            f"/runs/{lease['run']['id']}/fail", {"error": f"error {n}"}, token=lease["lease_token"]
        )
        assert r.status == 200, r.body
    return pipeline_id, task_id, coder


def test_failing_lists_the_tasks_failing_in_a_loop(client: Client) -> None:
    looping_pipeline, looping, _ = failing_task(client, 4)
    twice_pipeline, twice, _ = failing_task(client, 2)
    mended_pipeline, mended, coder = failing_task(client, 3)
    lease = claimed(client, coder)
    r = client.post(
        f"/runs/{lease['run']['id']}/transition", {"trigger": "submit"}, token=lease["lease_token"]
    )
    assert r.status == 200, r.body
    dead_pipeline, dead, _ = failing_task(client, 3, max_attempts=3)
    cancelled_pipeline, cancelled, _ = failing_task(client, 3)
    assert client.post(f"/tasks/{cancelled}/cancel").status == 200
    ours = {looping_pipeline, twice_pipeline, mended_pipeline, dead_pipeline, cancelled_pipeline}

    def listed(query: str = "") -> list[tuple[str, int]]:
        r = client.get("/ops/failing?limit=1000" + query)
        assert r.status == 200, r.body
        return [(x["task_id"], x["failures"]) for x in r.json["items"] if x["pipeline_id"] in ours]

    report = client.get("/ops/failing?limit=1000").json
    assert (report["window_ms"], report["min_failures"]) == (3_600_000, 3)
    [item] = [x for x in report["items"] if x["task_id"] == looping]
    assert (item["pipeline_id"], item["stage"], item["failures"]) == (looping_pipeline, "todo", 4)
    assert item["error"] == "error 4"
    assert item["last_failed_at_ms"] <= report["generated_at_ms"]
    details = client.get(f"/tasks/{looping}").json
    assert item["next_eligible_at_ms"] == details["next_eligible_at_ms"]
    assert item["title"] == details["title"]
    assert listed() == [(looping, 4)]
    assert listed("&min_failures=2") == [(looping, 4), (twice, 2)]
    assert listed("&min_failures=5") == []
    for query in ("min_failures=0", "window_ms=1000", "window_ms=86400001", "limit=0"):
        r = client.get(f"/ops/failing?{query}")
        assert r.status == 400, (query, r.body)
    assert {mended, dead, cancelled}.isdisjoint(t for t, _ in listed("&min_failures=1"))


def test_namespaces_are_listed_with_their_key_counts(client: Client) -> None:
    prefix = unique("zz-ns")
    names = [f"{prefix}-a", f"{prefix}-b"]
    for key in ("k1", "k2", "k3"):
        assert client.put(f"/store/{names[0]}/{key}", {"value": key}).status == 204
    assert client.put(f"/store/{names[1]}/only", {"value": 1}).status == 204
    # Namespaces by name, after the cursor: the prefix sorts right before this test's two.
    page = client.get(f"/namespaces?limit=1&cursor={prefix}").json
    assert [(n["namespace"], n["keys"]) for n in page["items"]] == [(names[0], 3)]
    assert page["items"][0]["updated_at_ms"] > 0
    assert page["next_cursor"] == names[0]
    page = client.get(f"/namespaces?limit=1&cursor={page['next_cursor']}").json
    assert [(n["namespace"], n["keys"]) for n in page["items"]] == [(names[1], 1)]
    everything = client.get("/namespaces?limit=1000").json["items"]
    assert {n["namespace"] for n in everything} >= set(names) or len(everything) == 1000
    assert client.get("/namespaces?limit=5000").error_code == "invalid_limit"


@pytest.mark.process
def test_the_python_clients_call_the_dashboards_routes(shared_server: Server) -> None:
    c = shared_server.client()
    pipeline_id, coder, _ = pipeline_with_roles(c)
    word = unique("Needle").replace("-", "")
    task_id = make_task(
        c,
        pipeline_id,
        title=f"find the {word}",
        retry_policy={"retry_delay_ms": 600_000, "max_attempts": 3},
    )
    lease = claimed(c, coder, agent="agent-py")
    r = c.post(f"/runs/{lease['run']['id']}/fail", {"error": "later"}, token=lease["lease_token"])
    assert r.status == 200, r.body
    ns = unique("py-ns")
    assert c.put(f"/store/{ns}/k", {"value": 1}).status == 204
    c.close()
    with pyclient.Client(shared_server.base) as api:
        assert [t.id for t in api.list_tasks(text=word.lower()).items] == [task_id]
        [run] = api.list_task_runs(task_id).items
        assert (run.agent_id, run.status, run.error) == ("agent-py", "failed", "later")
        waiting = [w for w in api.retry_report(limit=1000).items if w.task_id == task_id]
        assert [w.error for w in waiting] == ["later"]
        assert api.list_task_runs(task_id, newest_first=True, limit=1).items[0].id == run.id
        failing = api.failing_report(min_failures=1, window_ms=600_000, limit=1000)
        assert [f.error for f in failing.items if f.task_id == task_id] == ["later"]
        page = api.list_namespaces(limit=1, cursor=ns[:-1])
        assert [(n.namespace, n.keys) for n in page.items] == [(ns, 1)]

    async def from_async() -> tuple[list[str], list[str | None]]:
        async with AsyncClient(shared_server.base) as api:
            tasks = await api.list_tasks(text=word.upper(), pipeline_id=pipeline_id)
            runs = await api.list_task_runs(task_id, limit=1, newest_first=True)
            await api.retry_report()
            await api.failing_report(min_failures=2)
            await api.list_namespaces()
            return [t.id for t in tasks.items], [r.agent_id for r in runs.items]

    assert asyncio.run(from_async()) == ([task_id], ["agent-py"])
