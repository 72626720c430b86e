"""The dashboard in a real headless Chromium (Debian's chromium and chromedriver, installed by
scripts/browser.sh), driven with Selenium. The driver's path is given explicitly, so Selenium
Manager never runs and nothing is downloaded. Every wait is on a condition of the page.

NULLTICKETS_SCREENSHOTS=docs writes the README's screenshots (docs/dashboard-*.png); otherwise
they go to the test's temporary directory.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import WebDriverWait

from tests.conftest import claimed, make_task, pipeline_with_roles, unique
from tests.server import Client, Server

TOKEN = "browser-secret"
WAIT_S = 20


def _binary(*names: str) -> str:
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    raise RuntimeError(f"none of {names} is installed: run `make browser` (scripts/browser.sh)")


@pytest.fixture(scope="session")
def driver() -> Iterator[WebDriver]:
    options = webdriver.ChromeOptions()
    options.binary_location = _binary("chromium", "chromium-browser")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.add_argument("--window-size=1280,900")
    service = Service(executable_path=_binary("chromedriver"))
    browser = webdriver.Chrome(service=service, options=options)
    yield browser
    browser.quit()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(tmp_path_factory.mktemp("browser") / "browser.db").start()
    yield s
    s.stop()


@pytest.fixture
def api(server: Server) -> Iterator[Client]:
    c = server.client()
    yield c
    c.close()


def wait(driver: WebDriver) -> WebDriverWait[WebDriver]:
    return WebDriverWait(driver, WAIT_S)


def visit(driver: WebDriver, server: Server, path: str) -> None:
    """Open a page and wait until its script has drawn it."""
    driver.get(server.base + path)
    wait(driver).until(lambda d: d.find_element(By.ID, "main").get_attribute("data-ready"))


def shot(driver: WebDriver, name: str, tmp_path: Path) -> Path:
    target = os.environ.get("NULLTICKETS_SCREENSHOTS")
    folder = Path(__file__).resolve().parents[2] / "docs" if target == "docs" else tmp_path
    folder.mkdir(exist_ok=True)
    path = folder / f"dashboard-{name}.png"
    assert driver.save_screenshot(str(path))
    return path


def submit(client: Client, lease: dict[str, Any], trigger: str, **body: Any) -> None:
    r = client.post(
        f"/runs/{lease['run']['id']}/transition",
        {"trigger": trigger, **body},
        token=lease["lease_token"],
    )
    assert r.status == 200, r.body


def test_every_page_loads(driver: WebDriver, server: Server, api: Client) -> None:
    pipeline_id, _, _ = pipeline_with_roles(api)
    task_id = make_task(api, pipeline_id)
    assert api.put(f"/store/{unique('ns')}/k", {"value": {"note": "hello"}}).status == 204
    visit(driver, server, "/")
    assert driver.current_url.endswith("/ui/")
    assert driver.find_element(By.ID, "stages").find_elements(By.CSS_SELECTOR, "tbody tr")
    assert driver.find_element(By.ID, "throughput").tag_name == "svg"
    visit(driver, server, f"/ui/tasks?pipeline_id={pipeline_id}")
    rows = driver.find_elements(By.CSS_SELECTOR, "#task-list tbody tr")
    assert [r.get_attribute("data-task") for r in rows] == [task_id]
    visit(driver, server, f"/ui/task/{task_id}")
    assert driver.find_element(By.ID, "task-stage").text == "todo"
    current = driver.find_element(By.CSS_SELECTOR, "#machine .node.current")
    assert current.get_attribute("data-stage") == "todo"
    visit(driver, server, "/ui/failures")
    assert driver.find_elements(By.ID, "no-failures") or driver.find_elements(By.ID, "failures")
    visit(driver, server, "/ui/store")
    assert driver.find_element(By.ID, "store-search")
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == []


def test_a_task_moves_from_claimable_to_done_live(
    driver: WebDriver, server: Server, api: Client, tmp_path: Path
) -> None:
    pipeline_id, coder, reviewer = pipeline_with_roles(api)
    task_id = make_task(api, pipeline_id, title="Write the parser")
    visit(driver, server, f"/ui/task/{task_id}")
    assert driver.find_element(By.ID, "task-stage").text == "todo"
    wait(driver).until(ec.text_to_be_present_in_element((By.ID, "live"), "live"))
    go = threading.Event()
    failure: list[BaseException] = []

    def agent() -> None:
        c = server.client()
        try:
            lease = claimed(c, coder, agent="agent-coder")
            r = c.post(
                f"/runs/{lease['run']['id']}/events",
                {"kind": "progress", "data": {"step": "parsing"}},
                token=lease["lease_token"],
            )
            assert r.status == 201, r.body
            r = c.put(
                f"/runs/{lease['run']['id']}/checkpoint",
                {"checkpoint": {"files": 3}},
                token=lease["lease_token"],
            )
            assert r.status == 200, r.body
            go.wait(WAIT_S)  # the page showed the review stage
            submit(c, lease, "submit", gates={"tests": True})
            review = claimed(c, reviewer, agent="agent-reviewer")
            submit(c, review, "approve")
        except BaseException as exc:
            failure.append(exc)
        finally:
            c.close()

    worker = threading.Thread(target=agent)
    worker.start()
    try:
        wait(driver).until(
            ec.presence_of_element_located((By.CSS_SELECTOR, ".timeline li[data-kind=checkpoint]"))
        )
        assert "parsing" in driver.find_element(By.CSS_SELECTOR, "[data-kind=progress]").text
        assert '"files": 3' in driver.find_element(By.ID, "checkpoint").text
    finally:
        go.set()
        worker.join(WAIT_S)
    assert failure == []
    wait(driver).until(ec.text_to_be_present_in_element((By.ID, "task-stage"), "done"))
    current = driver.find_element(By.CSS_SELECTOR, "#machine .node.current")
    assert current.get_attribute("data-stage") == "done"
    assert len(driver.find_elements(By.CSS_SELECTOR, ".timeline li[data-kind=transition]")) == 2
    shot(driver, "task", tmp_path)
    visit(driver, server, "/ui/")
    shot(driver, "overview", tmp_path)


def test_requeue_a_dead_letter_by_clicking(driver: WebDriver, server: Server, api: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(api)
    task_id = make_task(api, pipeline_id, retry_policy={"max_attempts": 1})
    lease = claimed(api, coder)
    r = api.post(
        f"/runs/{lease['run']['id']}/fail", {"error": "out of disk"}, token=lease["lease_token"]
    )
    assert r.status == 200, r.body
    assert api.get(f"/tasks/{task_id}").json["dead_letter_reason"]
    visit(driver, server, "/ui/failures")
    row = driver.find_element(By.CSS_SELECTOR, f"#failures tr[data-task='{task_id}']")
    assert "out of disk" in row.text
    row.find_element(By.CSS_SELECTOR, "button.requeue").click()
    wait(driver).until(lambda d: not d.find_elements(By.CSS_SELECTOR, f"tr[data-task='{task_id}']"))
    details = api.get(f"/tasks/{task_id}").json
    assert details["dead_letter_reason"] is None
    assert claimed(api, coder)["task"]["id"] == task_id


def test_search_the_store(driver: WebDriver, server: Server, api: Client) -> None:
    ns = unique("notes")
    word = unique("zebra").replace("-", "")
    assert api.put(f"/store/{ns}/a", {"value": {"text": f"the {word} crossed"}}).status == 204
    assert api.put(f"/store/{ns}/b", {"value": {"text": "nothing here"}}).status == 204
    visit(driver, server, "/ui/store")
    form = driver.find_element(By.ID, "store-search")
    form.find_element(By.NAME, "q").send_keys(word)
    form.find_element(By.CSS_SELECTOR, "button").click()
    wait(driver).until(ec.presence_of_element_located((By.CSS_SELECTOR, "#hits mark")))
    marks = driver.find_elements(By.CSS_SELECTOR, "#hits mark")
    assert [m.text for m in marks] == [word]
    visit(driver, server, f"/ui/store?namespace={ns}")
    keys = driver.find_elements(By.CSS_SELECTOR, "#keys tbody tr")
    assert len(keys) == 2


def test_log_in_with_the_token_and_be_refused_without_it(
    driver: WebDriver, tmp_path_factory: pytest.TempPathFactory
) -> None:
    secured = Server(tmp_path_factory.mktemp("secured") / "s.db", token=TOKEN).start()
    try:
        driver.delete_all_cookies()
        driver.get(secured.base + "/ui/")
        wait(driver).until(ec.url_contains("/ui/login"))  # the API refused the page's reads
        driver.find_element(By.ID, "token").send_keys("not-the-token")
        driver.find_element(By.CSS_SELECTOR, "#login button").click()
        alert = wait(driver).until(ec.presence_of_element_located((By.CLASS_NAME, "error")))
        assert "not the server's admin token" in alert.text
        driver.find_element(By.ID, "token").send_keys(TOKEN)
        driver.find_element(By.CSS_SELECTOR, "#login button").click()
        wait(driver).until(ec.presence_of_element_located((By.ID, "stages")))
        assert driver.current_url.endswith("/ui/")
        # The session cookie is HttpOnly: the page's script sees only the CSRF token.
        visible = driver.execute_script("return document.cookie")
        assert "nt_csrf=" in visible and "nt_session" not in visible and TOKEN not in visible
        wait(driver).until(ec.text_to_be_present_in_element((By.ID, "live"), "live"))
    finally:
        driver.delete_all_cookies()
        secured.stop()


def test_the_run_timeline_names_the_agent_of_every_run(
    driver: WebDriver, server: Server, api: Client
) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(api)
    task_id = make_task(api, pipeline_id, retry_policy={"max_attempts": 5})
    first = claimed(api, coder, agent="agent-first")
    r = api.post(f"/runs/{first['run']['id']}/fail", {"error": "flaky"}, token=first["lease_token"])
    assert r.status == 200, r.body
    second = claimed(api, coder, agent="agent-second")
    assert second["task"]["id"] == task_id
    visit(driver, server, f"/ui/task/{task_id}")
    # Read in one script: the page redraws as the stream replays the task's events.
    read = (
        "return [...document.querySelectorAll('.run')].map((r) => "
        "[r.dataset.run, r.querySelector('h3 .agent').textContent, r.textContent]);"
    )
    expected = [
        [first["run"]["id"], "agent-first"],
        [second["run"]["id"], "agent-second"],
    ]
    runs = wait(driver).until(
        lambda d: (found := d.execute_script(read)) and [f[:2] for f in found] == expected and found
    )
    assert "claimed by agent-first" in runs[0][2] and "flaky" in runs[0][2]


def test_the_task_list_filters_by_text_across_pages(
    driver: WebDriver, server: Server, api: Client
) -> None:
    pipeline_id, _, _ = pipeline_with_roles(api)
    word = unique("Lexer").replace("-", "")
    # Matches far apart: a filter of the page at hand would find only the first of them.
    first = make_task(api, pipeline_id, title=f"Write the {word}")
    for _ in range(3):
        make_task(api, pipeline_id, title="unrelated")
    second = make_task(api, pipeline_id, title=f"Test the {word.upper()}")
    third = make_task(api, pipeline_id, title=f"Ship the {word}")
    visit(driver, server, f"/ui/tasks?pipeline_id={pipeline_id}&limit=2")
    form = driver.find_element(By.CSS_SELECTOR, "form.filters")
    form.find_element(By.NAME, "q").send_keys(word.lower())
    form.find_element(By.CSS_SELECTOR, "button").click()
    wait(driver).until(ec.url_contains("q="))
    wait(driver).until(lambda d: d.find_element(By.ID, "main").get_attribute("data-ready"))

    def listed() -> list[str | None]:
        rows = driver.find_elements(By.CSS_SELECTOR, "#task-list tbody tr")
        return [row.get_attribute("data-task") for row in rows]

    assert listed() == [first, second]
    assert driver.find_element(By.NAME, "q").get_attribute("value") == word.lower()
    driver.find_element(By.ID, "next-page").click()
    wait(driver).until(ec.url_contains("cursor="))
    wait(driver).until(lambda d: listed() == [third])
    assert not driver.find_elements(By.ID, "next-page")


def test_the_failures_page_lists_retry_waits_with_requeue_and_cancel(
    driver: WebDriver, server: Server, api: Client
) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(api)
    retry = {"retry_delay_ms": 3_600_000, "max_attempts": 5}
    waiting = []
    for error in ("rate limited", "upstream timeout"):
        task_id = make_task(api, pipeline_id, retry_policy=retry)
        lease = claimed(api, coder)
        assert lease["task"]["id"] == task_id
        r = api.post(
            f"/runs/{lease['run']['id']}/fail", {"error": error}, token=lease["lease_token"]
        )
        assert r.status == 200, r.body
        waiting.append(task_id)
    visit(driver, server, "/ui/failures")
    rows = {
        row.get_attribute("data-task"): row
        for row in driver.find_elements(By.CSS_SELECTOR, "#retrying tbody tr")
    }
    assert set(waiting) <= set(rows)
    assert "rate limited" in rows[waiting[0]].find_element(By.CLASS_NAME, "error-text").text
    eligible = rows[waiting[1]].find_element(By.CLASS_NAME, "eligible")
    [item] = [x for x in api.get("/ops/retrying").json["items"] if x["task_id"] == waiting[1]]
    assert eligible.get_attribute("data-at") == str(item["next_eligible_at_ms"])
    assert "(in " in eligible.text
    rows[waiting[0]].find_element(By.CSS_SELECTOR, "button.requeue").click()
    gone = f"#retrying tr[data-task='{waiting[0]}']"
    wait(driver).until(lambda d: not d.find_elements(By.CSS_SELECTOR, gone))
    assert claimed(api, coder)["task"]["id"] == waiting[0]  # claimable at once
    driver.find_element(
        By.CSS_SELECTOR, f"#retrying tr[data-task='{waiting[1]}'] button.cancel"
    ).click()
    dead = f"#failures tr[data-task='{waiting[1]}']"
    wait(driver).until(ec.presence_of_element_located((By.CSS_SELECTOR, dead)))
    assert not driver.find_elements(By.CSS_SELECTOR, f"#retrying tr[data-task='{waiting[1]}']")
    assert api.get(f"/tasks/{waiting[1]}").json["cancelled_at_ms"]


def test_the_store_page_lists_namespaces_and_their_keys(
    driver: WebDriver, server: Server, api: Client
) -> None:
    ns = unique("aaa-shelf")
    for key in ("one", "two"):
        assert api.put(f"/store/{ns}/{key}", {"value": {"key": key}}).status == 204
    visit(driver, server, "/ui/store")
    row = driver.find_element(By.CSS_SELECTOR, f"#namespaces tr[data-namespace='{ns}']")
    assert row.find_element(By.CSS_SELECTOR, "td.num").text == "2"
    row.find_element(By.LINK_TEXT, ns).click()
    wait(driver).until(ec.url_contains("namespace="))
    wait(driver).until(ec.presence_of_element_located((By.ID, "keys")))
    keys = driver.find_elements(By.CSS_SELECTOR, "#keys tbody tr code")
    assert [k.text for k in keys][::2] == ["one", "two"]
    chosen = driver.find_element(By.CSS_SELECTOR, "#namespaces tr.chosen")
    assert chosen.get_attribute("data-namespace") == ns


def test_a_read_key_logs_in_and_is_offered_no_buttons(
    driver: WebDriver, tmp_path_factory: pytest.TempPathFactory
) -> None:
    secured = Server(tmp_path_factory.mktemp("read-key") / "s.db", token=TOKEN).start()
    admin = secured.client(TOKEN)
    try:
        pipeline_id, coder, _ = pipeline_with_roles(admin)
        task_id = make_task(admin, pipeline_id, retry_policy={"max_attempts": 1})
        lease = claimed(admin, coder)
        r = admin.post(
            f"/runs/{lease['run']['id']}/fail", {"error": "out of disk"}, token=lease["lease_token"]
        )
        assert r.status == 200, r.body
        made = admin.post("/keys", {"name": "viewer", "access": "read"})
        assert made.status == 201, made.body
        driver.delete_all_cookies()
        driver.get(secured.base + "/ui/login")
        driver.find_element(By.ID, "token").send_keys(made.json["key"])
        driver.find_element(By.CSS_SELECTOR, "#login button").click()
        wait(driver).until(ec.presence_of_element_located((By.ID, "stages")))
        assert driver.find_elements(By.CSS_SELECTOR, "form.logout")  # a session to end
        visit(driver, secured, "/ui/failures")
        row = driver.find_element(By.CSS_SELECTOR, f"#failures tr[data-task='{task_id}']")
        assert "out of disk" in row.text
        assert driver.find_elements(By.CSS_SELECTOR, "button.requeue, button.cancel") == []
        visit(driver, secured, f"/ui/task/{task_id}")
        assert driver.find_element(By.ID, "task-stage").text
        assert driver.find_elements(By.CSS_SELECTOR, "button.requeue, button.cancel") == []
        # What a button would have sent is refused by the API itself.
        status = driver.execute_async_script(
            """const done = arguments[arguments.length - 1];
            const csrf = document.cookie.match(/nt_csrf=([^;]+)/)[1];
            fetch(arguments[0], {method: "POST", headers: {"X-CSRF-Token": csrf,
                "Content-Type": "application/json"}, body: "{}"}).then((r) => done(r.status));""",
            f"/tasks/{task_id}/requeue",
        )
        assert status == 403
        assert admin.get(f"/tasks/{task_id}").json["dead_letter_reason"]
    finally:
        driver.delete_all_cookies()
        admin.close()
        secured.stop()


def test_log_out_shows_only_on_a_server_with_a_token(driver: WebDriver, server: Server) -> None:
    visit(driver, server, "/ui/")
    assert driver.find_elements(By.CSS_SELECTOR, "form.logout") == []
    assert driver.find_elements(By.CSS_SELECTOR, "header nav a")
