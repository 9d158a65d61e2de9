"""Headless Chromium for the browser tests, driven through Selenium.

Chromium and chromedriver come from the Debian packages ``chromium`` and ``chromium-driver``,
which ``make test`` installs through ``scripts/ensure_chromium.sh``. Without them these tests
fail (they never skip): set ``SLOT_TRACKER_CHROMIUM`` / ``SLOT_TRACKER_CHROMEDRIVER`` to use
binaries elsewhere.

``chromium(logs=...)`` starts a browser for a test module; with ``logs=True`` it records the
console (``driver.get_log("browser")``) and every request a page makes
(``requested_urls(driver)``), to prove a page loads nothing from elsewhere.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path(os.environ.get("SLOT_TRACKER_CHROMIUM", "/usr/bin/chromium"))
CHROMEDRIVER = Path(os.environ.get("SLOT_TRACKER_CHROMEDRIVER", "/usr/bin/chromedriver"))
CHROME_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--no-first-run",
    "--no-default-browser-check",
    "--force-color-profile=srgb",
    "--hide-scrollbars",
    "--lang=en-US",
    "--window-size=1280,900",
)


@pytest.fixture(scope="module")
def chromium(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Any]]:
    """``chromium(logs=False)``: a new headless Chromium, quit when the module ends."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        pytest.fail(
            f"the browser tests need headless Chromium, but {', '.join(missing)} "
            "is missing. Run `scripts/ensure_chromium.sh` (as root: apt-get install chromium "
            "chromium-driver), which `make test` does, or point SLOT_TRACKER_CHROMIUM and "
            "SLOT_TRACKER_CHROMEDRIVER at a Chromium and its matching chromedriver.",
            pytrace=False,
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    drivers: list[Any] = []

    def start(logs: bool = False) -> Any:
        options = Options()
        options.binary_location = str(CHROMIUM)
        for flag in CHROME_FLAGS:
            options.add_argument(flag)
        profile = tempfile.mkdtemp(prefix="chromium-", dir=tmp_path_factory.getbasetemp())
        options.add_argument(f"--user-data-dir={profile}")
        if logs:
            options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
        driver = webdriver.Chrome(
            service=Service(executable_path=str(CHROMEDRIVER)), options=options
        )
        drivers.append(driver)
        return driver

    try:
        yield start
    finally:
        for driver in drivers:
            driver.quit()


def requested_urls(driver: Any) -> list[str]:
    """Every URL the page asked for since the last call (from the DevTools network log)."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls
