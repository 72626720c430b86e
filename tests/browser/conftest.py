"""What every browser test shares: Debian's chromium and chromedriver (installed by
scripts/browser.sh), driven with Selenium with the driver's path given explicitly, so Selenium
Manager never runs and nothing is downloaded; and a server of each module's own."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.remote.webdriver import WebDriver

from tests.server import Client, Server


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
