"""A page of another origin, opened in a real headless Chromium, against a default server
(loopback, no token): what it sends reaches the server and is refused, so it creates nothing,
cancels nothing and reads nothing; the dashboard in the same browser keeps working.

The page is served by a small http.server on another loopback port, as `localhost` (another
site than 127.0.0.1) and as `127.0.0.1` (the same site, another origin)."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import WebDriverWait

from tests.conftest import make_task, pipeline_with_roles, unique
from tests.server import Client, Server

WAIT_S = 20

# Everything a page may try without the server's consent: simple no-cors writes (their answer
# stays hidden from the page, but on a server that does not check they are carried out), a
# beacon, a CORS read and an event stream.
PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>elsewhere</title></head>
<body><p>Nothing to see here.</p><script>
const target = %(target)s, create = %(create)s, victim = %(victim)s, pipeline = %(pipeline)s;
const results = {};
const simple = (path, body) => fetch(target + path, {
  method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"}, body,
}).then((r) => r.type);
async function attempt(name, run) {
  try { results[name] = String(await run()); } catch (err) { results[name] = "error: " + err; }
}
(async () => {
  await attempt("create", () => simple("/tasks", create));
  await attempt("cancel", () => simple("/tasks/" + victim + "/cancel", "{}"));
  await attempt("beacon", () => navigator.sendBeacon(
    target + "/tasks", new Blob([create], {type: "text/plain"})));
  await attempt("read", async () =>
    (await fetch(target + "/tasks?pipeline_id=" + pipeline)).text());
  await attempt("stream", () => new Promise((resolve) => {
    const es = new EventSource(target + "/events/stream");
    es.onmessage = (ev) => { es.close(); resolve("message: " + ev.data); };
    es.onerror = () => { es.close(); resolve("error"); };
  }));
  window.results = results;
})();
</script></body></html>"""


class Site:
    """Another origin: serves one page at / until closed."""

    def __init__(self) -> None:
        self.page = b""
        site = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                found = self.path == "/"
                body = site.page if found else b"not found"
                self.send_response(200 if found else 404)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def site() -> Iterator[Site]:
    s = Site()
    yield s
    s.close()


def answered(api: Client, status: str = "") -> int:
    """How many requests the server answered (with `status`), by its own /metrics; its
    answers to /metrics itself left out."""
    text = api.get("/metrics").body.decode()
    total = 0
    for line in text.splitlines():
        if (
            line.startswith("nulltickets_http_requests_total{")
            and 'route="/metrics"' not in line
            and f'status="{status}' in line
        ):
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


@pytest.mark.parametrize("name", ["localhost", "127.0.0.1"], ids=["cross-site", "same-site"])
def test_a_page_of_another_origin_cannot_create_cancel_or_read(
    driver: WebDriver, server: Server, api: Client, site: Site, name: str
) -> None:
    pipeline_id, _, _ = pipeline_with_roles(api)
    secret = unique("secret")
    victim = make_task(api, pipeline_id, title=secret)
    create = {"pipeline_id": pipeline_id, "title": "queued by a web page", "description": "rm -rf"}
    site.page = (
        PAGE
        % {
            "target": json.dumps(server.base),
            "create": json.dumps(json.dumps(create)),
            "victim": json.dumps(victim),
            "pipeline": json.dumps(pipeline_id),
        }
    ).encode()
    before, refused_before = answered(api), answered(api, "403")
    driver.get(f"http://{name}:{site.port}/")
    results = WebDriverWait(driver, WAIT_S).until(
        lambda d: d.execute_script("return window.results")
    )
    # The writes left the browser (no-cors: the page cannot see how they ended) ...
    assert results["create"] == "opaque" and results["cancel"] == "opaque", results
    assert results["beacon"] == "true", results
    # ... and nothing came back to the page.
    assert results["read"].startswith("error"), results
    assert secret not in json.dumps(results)
    assert results["stream"] == "error", results
    # The server saw all five (the beacon may land a little later) ...
    WebDriverWait(driver, WAIT_S).until(lambda _: answered(api) - before >= 5)
    # ... and did nothing they asked: no task, no cancel ...
    items = api.get(f"/tasks?pipeline_id={pipeline_id}").json["items"]
    assert [t["id"] for t in items] == [victim]
    details = api.get(f"/tasks/{victim}").json
    assert details.get("cancelled_at_ms") is None and details["stage"] == "todo"
    # ... because it refused each one.
    assert answered(api, "403") - refused_before >= 5


def test_the_dashboard_still_reads_streams_and_writes_in_the_same_browser(
    driver: WebDriver, server: Server, api: Client
) -> None:
    pipeline_id, _, _ = pipeline_with_roles(api)
    task_id = make_task(api, pipeline_id, title=unique("kept"))
    driver.get_log("browser")  # what the foreign page logged (its refused requests) is read
    driver.get(server.base + f"/ui/task/{task_id}")
    WebDriverWait(driver, WAIT_S).until(
        lambda d: d.find_element(By.ID, "main").get_attribute("data-ready")
    )
    assert driver.find_element(By.ID, "task-stage").text == "todo"
    WebDriverWait(driver, WAIT_S).until(ec.text_to_be_present_in_element((By.ID, "live"), "live"))
    # A write from the dashboard's own origin, as its buttons make it.
    status = driver.execute_async_script(
        """const done = arguments[arguments.length - 1];
        fetch(arguments[0], {method: "POST", headers: {"Content-Type": "application/json"},
                             body: JSON.stringify({reason: "from the dashboard"})})
          .then((r) => done(r.status), (err) => done(String(err)));""",
        f"/tasks/{task_id}/cancel",
    )
    assert status == 200
    assert api.get(f"/tasks/{task_id}").json["cancelled_at_ms"]
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == []
