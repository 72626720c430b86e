"""The browser checks every request passes first (http/origins.py), on plain header dicts."""

from __future__ import annotations

import pytest

from nulltickets.config import Settings
from nulltickets.errors import Forbidden
from nulltickets.http.errors import status_of
from nulltickets.http.origins import OriginGuard, host_name

OPEN = OriginGuard(Settings(port=7700))  # no token: Host is checked
KEYED = OriginGuard(Settings(port=7700, token="t"))  # a token: Host is not
LISTED = OriginGuard(
    Settings(
        port=7700,
        allowed_origins=("https://tracker.example",),
        allowed_hosts=("tracker.example",),
    )
)


def refused(
    guard: OriginGuard, headers: dict[str, str], method: str = "POST", path: str = "/tasks"
) -> bool:
    try:
        guard.check(headers, "http", method, path)
    except Forbidden as exc:
        assert status_of(exc) == 403 and exc.code == "forbidden"
        return True
    return False


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1:7700",
        "127.0.0.1",
        "LOCALHOST:7700",
        "localhost.:7700",
        "app.localhost:7700",
        "127.8.9.10:1",
        "[::1]:7700",
        "[0:0:0:0:0:0:0:1]",
    ],
)
def test_a_server_without_a_token_answers_to_loopback_names(host: str) -> None:
    assert not refused(OPEN, {"host": host}, "GET")


@pytest.mark.parametrize(
    "host",
    [
        "evil.example:7700",
        "evil.example",
        "127.0.0.1.evil.example",
        "127.evil.example",
        "localhost.evil.example",
        "evillocalhost",
        "10.0.0.1:7700",
        "[::2]:7700",
        "",
        "tracker.example",
    ],
)
def test_a_server_without_a_token_refuses_other_names(host: str) -> None:
    assert refused(OPEN, {"host": host}, "GET")


def test_allowed_hosts_add_names_and_a_token_turns_the_host_check_off() -> None:
    assert not refused(LISTED, {"host": "tracker.example:7700"}, "GET")
    assert refused(LISTED, {"host": "evil.example:7700"}, "GET")
    assert not refused(KEYED, {"host": "evil.example:7700"}, "GET")


def test_the_bind_address_counts_as_a_name() -> None:
    guard = OriginGuard(Settings(host="::1", port=7700))
    assert "[::1]" in (guard.names or ())
    named = OriginGuard(Settings(host="Tracker.Local", port=7700))
    assert not refused(named, {"host": "tracker.local:7700"}, "GET")


def test_no_origin_and_no_host_is_a_client_that_is_not_a_browser() -> None:
    assert not refused(OPEN, {})
    assert not refused(KEYED, {"host": "127.0.0.1:7700"})


@pytest.mark.parametrize("guard", [OPEN, KEYED], ids=["no-token", "token"])
@pytest.mark.parametrize(
    "origin",
    [
        "http://evil.example",
        "null",
        "http://127.0.0.1:7701",
        "http://localhost:7700",  # another name is another origin
        "https://127.0.0.1:7700",
        "http://127.0.0.1:7700.evil.example",
        "",
    ],
)
def test_a_foreign_origin_is_refused(guard: OriginGuard, origin: str) -> None:
    assert refused(guard, {"host": "127.0.0.1:7700", "origin": origin})


def test_the_same_origin_and_listed_origins_are_admitted() -> None:
    same = {"host": "127.0.0.1:7700", "origin": "http://127.0.0.1:7700"}
    assert not refused(OPEN, same)
    assert not refused(KEYED, {"host": "Tracker.Example", "origin": "http://tracker.example"})
    listed = {"host": "127.0.0.1:7700", "origin": "https://tracker.example"}
    assert not refused(LISTED, listed)
    assert not refused(LISTED, {**listed, "sec-fetch-site": "cross-site"})
    assert refused(OPEN, listed)
    assert refused(OPEN, {"origin": "http://127.0.0.1:7700"})  # no Host to compare with


def test_behind_a_tls_proxy_that_keeps_host_the_https_origin_is_the_same() -> None:
    headers = {"host": "tracker.example", "origin": "https://tracker.example"}
    assert refused(KEYED, headers)
    assert not refused(KEYED, {**headers, "x-forwarded-proto": "https"})


def test_cross_site_fetches_are_refused_but_following_a_link_to_the_dashboard_is_not() -> None:
    cross = {"host": "127.0.0.1:7700", "sec-fetch-site": "cross-site"}
    visit = {**cross, "sec-fetch-mode": "navigate", "sec-fetch-dest": "document"}
    assert refused(OPEN, cross, "GET", "/tasks")
    assert refused(KEYED, cross, "GET", "/ui/")
    assert not refused(OPEN, visit, "GET", "/ui/task/x")
    assert not refused(OPEN, visit, "GET", "/")
    assert refused(OPEN, visit, "GET", "/tasks")  # data, not a page
    assert refused(OPEN, visit, "POST", "/ui/login")
    assert refused(OPEN, {**visit, "sec-fetch-dest": "iframe"}, "GET", "/ui/")
    for site in ("same-origin", "same-site", "none"):
        assert not refused(OPEN, {**cross, "sec-fetch-site": site})


def test_host_name_drops_the_port_and_the_case() -> None:
    assert host_name("Example.COM:80") == "example.com"
    assert host_name("[::1]:7700") == "[::1]"
    assert host_name("[::1") == "[::1"
    assert host_name("localhost.") == "localhost"
