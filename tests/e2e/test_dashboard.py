"""The dashboard's routes over HTTP (without a browser): pages, files, the login and its
session cookie, the CSRF defence, and GET /ops/stages, which the overview draws."""

from __future__ import annotations

import http.client
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import pytest

from tests.conftest import claimed, make_task, pipeline_with_roles, unique
from tests.server import Client, Server

TOKEN = "dashboard-secret"


@pytest.fixture(scope="module")
def secured_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(tmp_path_factory.mktemp("dash") / "dash.db", token=TOKEN).start()
    yield server
    server.stop()


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
    assert r.error_code == "not_found"
    r = client.post("/", {})
    assert (r.status, r.error_code) == (404, "not_found")


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


def test_a_wrong_token_is_refused_and_sets_no_cookie(secured_server: Server) -> None:
    r = login(secured_server, "wrong")
    assert r.status == 401
    assert r.content_type.startswith("text/html")
    assert r.set_cookie == []


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


def test_writes_with_the_cookie_need_the_csrf_token_and_the_same_origin(
    browser: Client, secured_server: Server
) -> None:
    r = login(secured_server)
    jar, csrf, session = r.jar, r.value("nt_csrf"), r.value("nt_session")
    body = {"name": unique("pipe"), "definition": _definition()}
    host = f"127.0.0.1:{secured_server.port}"
    refused = [
        {"Cookie": jar},
        {"Cookie": jar, "X-CSRF-Token": "0" * 64},
        {"Cookie": jar, "X-CSRF-Token": csrf, "Origin": "http://evil.example"},
    ]
    for headers in refused:
        answer = browser.post("/pipelines", body, headers={**headers, "Host": host})
        assert (answer.status, answer.error_code) == (401, "unauthorized"), headers
    ok = {"Cookie": jar, "X-CSRF-Token": csrf, "Origin": f"http://{host}", "Host": host}
    assert browser.post("/pipelines", body, headers=ok).status == 201
    # A forged session (another token's MAC) opens nothing.
    forged = jar.replace(session, "1.deadbeef")
    assert browser.get("/ops/stages", headers={"Cookie": forged}).status == 401


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
