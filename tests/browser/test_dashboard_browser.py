"""The dashboard in a real headless Chromium (Debian's chromium and chromedriver, installed by
scripts/browser.sh), driven with Selenium. The driver's path is given explicitly, so Selenium
Manager never runs and nothing is downloaded. Every wait is on a condition of the page.

NULLTICKETS_SCREENSHOTS=docs writes the README's screenshots (docs/dashboard-*.png); otherwise
they go to the test's temporary directory.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import WebDriverWait

from tests.conftest import claimed, make_task, pipeline_with_roles, unique
from tests.server import Client, Server

TOKEN = "browser-secret"
WAIT_S = 20


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
    expected = [  # newest first
        [second["run"]["id"], "agent-second"],
        [first["run"]["id"], "agent-first"],
    ]
    runs = wait(driver).until(
        lambda d: (found := d.execute_script(read)) and [f[:2] for f in found] == expected and found
    )
    assert "claimed by agent-first" in runs[1][2] and "flaky" in runs[1][2]


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
    wait(driver).until(ec.alert_is_present()).accept()  # Cancel asks first
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


# --- failures, from the server's listing -------------------------------------------------------

FILLER = 2_100  # more tasks than the page once scanned in the browser (the oldest 2,000)
DEAD = 55  # more dead letters than one page of the Failures page (50)


def _dead_letter_pipeline(api: Client) -> tuple[str, str]:
    role = unique("coder")
    definition = {
        "initial": "todo",
        "states": {
            "todo": {"agent_role": role},
            "done": {"terminal": True},
            "dead": {"terminal": True},
        },
        "transitions": [{"from": "todo", "to": "done", "trigger": "submit"}],
    }
    r = api.post("/pipelines", {"name": unique("failing"), "definition": definition})
    assert r.status == 201, r.body
    return str(r.json["id"]), role


def _fail(api: Client, role: str, error: str) -> str:
    lease = claimed(api, role)
    r = api.post(f"/runs/{lease['run']['id']}/fail", {"error": error}, token=lease["lease_token"])
    assert r.status == 200, r.body
    return str(lease["task"]["id"])


@pytest.fixture(scope="module")
def crowded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A server of its own with 2,100 ordinary tasks, then 55 dead letters in a dead-letter
    stage without a role (the newest failed twice), and one cancelled task."""
    server = Server(tmp_path_factory.mktemp("crowded") / "crowded.db").start()
    api = server.client()
    filler, _ = _dead_letter_pipeline(api)
    for start in range(0, FILLER, 300):  # a bulk body stays under the body limit
        tasks = [
            {"pipeline_id": filler, "title": f"filler {start + i}", "description": ""}
            for i in range(min(300, FILLER - start))
        ]
        r = api.post("/tasks/bulk", {"tasks": tasks})
        assert r.status == 201, r.body
    pipeline_id, role = _dead_letter_pipeline(api)
    dead: list[str] = []
    for i in range(DEAD - 1):
        make_task(
            api,
            pipeline_id,
            title=f"dead {i}",
            retry_policy={"max_attempts": 1, "dead_letter_stage": "dead"},
        )
        dead.append(_fail(api, role, "disk full" if i % 2 else "timeout"))
    policy = {"max_attempts": 2, "dead_letter_stage": "dead", "retry_delay_ms": 0}
    newest = make_task(api, pipeline_id, title="the newest dead letter", retry_policy=policy)
    assert _fail(api, role, "first error") == newest
    assert _fail(api, role, "second error") == newest
    dead.append(newest)
    cancelled = make_task(api, pipeline_id, title="cancelled one")
    assert api.post(f"/tasks/{cancelled}/cancel", {"reason": "not needed"}).status == 200
    yield {"server": server, "api": api, "pipeline_id": pipeline_id, "role": role,
           "dead": dead, "newest": newest, "cancelled": cancelled}  # fmt: skip
    api.close()
    server.stop()


def _click(driver: WebDriver, css: str) -> None:
    """Click what `css` finds as it is now: the page redraws when the live stream reports
    something, which would make an element found before the click stale (what is ticked
    stays ticked across redraws)."""
    wait(driver).until(ec.presence_of_element_located((By.CSS_SELECTOR, css)))
    driver.execute_script("document.querySelector(arguments[0]).click();", css)


def _rows(driver: WebDriver) -> list[str]:
    """The tasks of the Failures page's table, read in one script (the page may redraw)."""
    read = "return [...document.querySelectorAll('#failures tbody tr')].map((r) => r.dataset.task);"
    rows: list[str] = driver.execute_script(read)
    return rows


def test_the_failures_page_shows_the_newest_dead_letter_among_thousands_of_tasks(
    driver: WebDriver, crowded: dict[str, Any], tmp_path: Path
) -> None:
    server, newest = crowded["server"], crowded["newest"]
    assert len(crowded["api"].get("/tasks?limit=1000").json["items"]) == 1000
    visit(driver, server, "/ui/failures?kind=dead")
    rows = _rows(driver)
    assert rows[0] == newest and len(rows) == 50  # newest first, one page
    first = driver.find_element(By.CSS_SELECTOR, f"#failures tr[data-task='{newest}']")
    assert first.find_element(By.CLASS_NAME, "last-error").text == "second error"  # the last
    assert first.find_element(By.CLASS_NAME, "failures").text == "2"
    assert (
        first.find_element(By.CSS_SELECTOR, ".pill").get_attribute("data-state") == "dead_lettered"
    )
    assert not first.find_elements(By.CSS_SELECTOR, "button.cancel")  # it sits in a terminal stage
    shot(driver, "failures", tmp_path)
    _click(driver, "#older-page")
    wait(driver).until(ec.url_contains("cursor="))
    wait(driver).until(lambda d: _rows(d) == crowded["dead"][: DEAD - 50][::-1])
    assert not driver.find_elements(By.ID, "older-page")


def test_a_cancelled_task_is_labelled_cancelled_not_dead_lettered(
    driver: WebDriver, crowded: dict[str, Any]
) -> None:
    cancelled = crowded["cancelled"]
    visit(driver, crowded["server"], "/ui/failures")
    row = driver.find_element(By.CSS_SELECTOR, f"#failures tr[data-task='{cancelled}']")
    pill = row.find_element(By.CSS_SELECTOR, ".pill")
    assert pill.get_attribute("data-state") == "cancelled" and pill.text == "cancelled"
    assert "not needed" in row.text


def test_the_overview_counts_dead_letters_where_they_landed(
    driver: WebDriver, crowded: dict[str, Any]
) -> None:
    visit(driver, crowded["server"], "/ui/")
    total = driver.find_element(By.CSS_SELECTOR, "#total-dead_lettered .n").text
    assert total == str(DEAD) == str(crowded["api"].get("/ops/queue").json["dead_lettered"])
    assert driver.find_element(By.CSS_SELECTOR, "#total-cancelled .n").text == "1"
    row = driver.find_element(
        By.CSS_SELECTOR,
        f"#stages tr[data-stage='dead'][data-pipeline='{crowded['pipeline_id']}']",
    )
    assert row.get_attribute("data-role") == ""
    assert row.find_element(By.CLASS_NAME, "c-dead_lettered").text == str(DEAD)


def test_failures_group_by_error_and_a_group_opens_its_tasks(
    driver: WebDriver, crowded: dict[str, Any]
) -> None:
    pipeline_id = crowded["pipeline_id"]
    visit(
        driver, crowded["server"], f"/ui/failures?view=groups&kind=dead&pipeline_id={pipeline_id}"
    )
    groups = {
        g.get_attribute("data-error"): g.find_element(By.CLASS_NAME, "count").text
        for g in driver.find_elements(By.CSS_SELECTOR, "#failure-groups tbody tr")
    }
    half = (DEAD - 1) // 2
    assert groups == {"timeout": str(DEAD - 1 - half), "disk full": str(half), "second error": "1"}
    _click(driver, "#failure-groups tr[data-error='second error'] .show-group")
    wait(driver).until(ec.url_contains("error="))
    wait(driver).until(lambda d: _rows(d) == [crowded["newest"]])


def test_bulk_requeue_of_a_selection_asks_first(
    driver: WebDriver, server: Server, api: Client
) -> None:
    pipeline_id, role = _dead_letter_pipeline(api)
    picked = []
    for error in ("a", "b", "c"):
        make_task(api, pipeline_id, retry_policy={"max_attempts": 1})
        picked.append(_fail(api, role, error))
    visit(driver, server, f"/ui/failures?kind=dead&pipeline_id={pipeline_id}")
    assert set(_rows(driver)) == set(picked)
    for task_id in picked[:2]:
        _click(driver, f"input.pick[data-task='{task_id}']")
    assert driver.find_element(By.ID, "selected-count").text == "2 selected"
    _click(driver, "#requeue-selected")
    alert = wait(driver).until(ec.alert_is_present())
    assert alert.text == "Requeue 2 tasks?"
    alert.dismiss()  # nothing happens
    assert api.get(f"/tasks/{picked[0]}").json["dead_letter_reason"] == "max_attempts_exceeded"
    _click(driver, "#requeue-selected")
    wait(driver).until(ec.alert_is_present()).accept()
    wait(driver).until(lambda d: _rows(d) == [picked[2]])
    assert "Requeued 2 tasks" in driver.find_element(By.ID, "bulk-report").text
    assert {claimed(api, role)["task"]["id"] for _ in range(2)} == set(picked[:2])
    # Cancel the rest of the page: select all, confirm.
    _click(driver, "#select-page")
    _click(driver, "#cancel-selected")
    wait(driver).until(ec.alert_is_present()).accept()
    wait(driver).until(lambda d: d.find_elements(By.ID, "no-failures"))
    assert api.get(f"/tasks/{picked[2]}").json["cancelled_at_ms"]


# A live page redraws whenever the stream reports something (a task page first replays its
# history), replacing its elements: read and click what the page shows at that moment.


def text(driver: WebDriver, css: str) -> str | None:
    found: str | None = driver.execute_script(
        "const e = document.querySelector(arguments[0]); return e ? e.textContent : null;", css
    )
    return found


def click(driver: WebDriver, css: str) -> None:
    WebDriverWait(driver, WAIT_S, ignored_exceptions=(StaleElementReferenceException,)).until(
        lambda d: d.find_element(By.CSS_SELECTOR, css).click() or True
    )


def fail_run(client: Client, lease: dict[str, Any], error: str = "boom") -> None:
    r = client.post(
        f"/runs/{lease['run']['id']}/fail", {"error": error}, token=lease["lease_token"]
    )
    assert r.status == 200, r.body


def test_cancel_is_offered_only_on_unfinished_tasks_and_asks_first(
    driver: WebDriver, server: Server, api: Client
) -> None:
    pipeline_id, coder, reviewer = pipeline_with_roles(api)
    done = make_task(api, pipeline_id, priority=1)
    submit(api, claimed(api, coder), "submit")
    submit(api, claimed(api, reviewer), "approve")
    assert api.get(f"/tasks/{done}").json["stage"] == "done"
    visit(driver, server, f"/ui/task/{done}")
    assert driver.find_elements(By.CSS_SELECTOR, "button.requeue")
    assert not driver.find_elements(By.CSS_SELECTOR, "button.cancel")

    running = make_task(api, pipeline_id, title="Refactor the lexer")
    assert claimed(api, coder)["task"]["id"] == running
    visit(driver, server, f"/ui/task/{running}")
    click(driver, "button.cancel")
    alert = wait(driver).until(ec.alert_is_present())
    assert "Refactor the lexer" in alert.text
    alert.dismiss()  # changed one's mind: nothing happens
    assert "cancelled_at_ms" not in api.get(f"/tasks/{running}").json
    click(driver, "button.cancel")
    wait(driver).until(ec.alert_is_present()).accept()
    wait(driver).until(lambda d: "cancelled" in (text(d, "h1") or ""))
    assert api.get(f"/tasks/{running}").json["cancelled_at_ms"]
    assert text(driver, "button.cancel") is None  # cancelled: finished


def test_the_overview_names_pipelines_and_shows_a_task_failing_in_a_loop(
    driver: WebDriver, server: Server, api: Client
) -> None:
    name = unique("nightly-builds")
    coder = unique("coder")
    definition = {
        "initial": "todo",
        "states": {"todo": {"agent_role": coder}, "done": {"terminal": True}},
        "transitions": [{"from": "todo", "to": "done", "trigger": "submit"}],
    }
    r = api.post("/pipelines", {"name": name, "definition": definition})
    assert r.status == 201, r.body
    pipeline_id = r.json["id"]
    looping = make_task(api, pipeline_id, title="Flaky build", retry_policy={"retry_delay_ms": 0})
    for n in range(4):
        fail_run(api, claimed(api, coder), f"exit status 1 (try {n})")
    visit(driver, server, "/")
    row = text(driver, f"#stages tr[data-role='{coder}']") or ""
    assert name in row and pipeline_id[-8:] not in row
    failing = f"#failing tr[data-task='{looping}']"
    assert "Flaky build" in (text(driver, failing) or "") and name in (text(driver, failing) or "")
    assert text(driver, f"{failing} td.failures") == "4"
    assert "try 3" in (text(driver, f"{failing} td.error-text") or "")
    click(driver, f"{failing} a[href='/ui/task/{looping}']")
    wait(driver).until(ec.url_contains(f"/ui/task/{looping}"))
    wait(driver).until(lambda d: text(d, "#task-pipeline") == name)


def test_a_tasks_runs_are_listed_newest_first_page_by_page(
    driver: WebDriver, server: Server, api: Client
) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(api)
    task_id = make_task(api, pipeline_id, retry_policy={"retry_delay_ms": 0})
    for n in range(1, 6):
        fail_run(api, claimed(api, coder, agent=f"agent-{n}"))
    claimed(api, coder, agent="agent-6")
    visit(driver, server, f"/ui/task/{task_id}?runs_limit=2")

    def attempts() -> list[str]:
        found: list[str] = driver.execute_script(
            "return [...document.querySelectorAll('.run')].map((r) => r.dataset.attempt);"
        )
        return found

    pages = [attempts()]
    while text(driver, "#older-runs") is not None:
        click(driver, "#older-runs")
        wait(driver).until(lambda d, seen=pages[-1]: (now := attempts()) and now != seen)
        pages.append(attempts())
    assert pages == [["6", "5"], ["4", "3"], ["2", "1"]]
    click(driver, "#newest-runs")
    wait(driver).until(lambda d: attempts() == ["6", "5"])


def test_a_task_waiting_on_a_retry_delay_says_when_it_comes_back(
    driver: WebDriver, server: Server, api: Client
) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(api)
    task_id = make_task(api, pipeline_id, retry_policy={"retry_delay_ms": 3_600_000})
    fail_run(api, claimed(api, coder))
    visit(driver, server, f"/ui/task/{task_id}")
    at = driver.execute_script("return document.getElementById('eligible').dataset.at;")
    assert at == str(api.get(f"/tasks/{task_id}").json["next_eligible_at_ms"])
    assert "claimable again" in (text(driver, "#eligible") or "")


def test_the_store_badge_tells_whether_the_page_is_live(
    driver: WebDriver, tmp_path_factory: pytest.TempPathFactory
) -> None:
    own = Server(tmp_path_factory.mktemp("badge") / "badge.db").start()
    try:
        client = own.client()
        visit(driver, own, "/ui/store")
        badge = driver.find_element(By.ID, "live")
        wait(driver).until(lambda d: badge.get_attribute("data-state") == "live")
        assert "live" in badge.text and "connecting" not in badge.text
        # Live indeed: a namespace written now shows up without a reload.
        ns = unique("fresh")
        assert client.put(f"/store/{ns}/k", {"value": 1}).status == 204
        client.close()
        wait(driver).until(
            ec.presence_of_element_located((By.CSS_SELECTOR, f"tr[data-namespace='{ns}']"))
        )
        own.stop()
        wait(driver).until(lambda d: badge.get_attribute("data-state") == "reconnecting")
        assert "reconnecting" in badge.text
    finally:
        own.stop()


def test_the_store_page_lists_a_namespace_holding_a_slash(
    driver: WebDriver, server: Server, api: Client
) -> None:
    team = unique("aaa-team")
    # team/alpha's key, and team's key alpha/notes: two entries, two namespaces.
    assert api.put(f"/store/{team}%252Falpha/notes", {"value": 1}).status == 204
    assert api.put(f"/store/{team}/alpha%2Fnotes", {"value": 2}).status == 204
    visit(driver, server, f"/ui/store?namespace={team}%2Falpha")
    wait(driver).until(ec.presence_of_element_located((By.ID, "keys")))
    keys = driver.find_elements(By.CSS_SELECTOR, "#keys tbody tr code")
    assert [k.text for k in keys][::2] == ["notes"]


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
