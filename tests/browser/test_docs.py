"""``/docs`` and ``/redoc`` render in a real headless Chromium with nothing but the instance.

The machine has no internet, and the test fails anyway if either page asks any host but the
instance for anything (DevTools network log and the page's resource timing), or logs a console
error: Swagger UI must list every operation of the OpenAPI document and ReDoc's menu must too.
The instance has an API key: the pages and their assets are open all the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from kv_slot_tracker.main import create_app
from kv_slot_tracker.settings import load_settings
from tests.browser.conftest import requested_urls
from tests.servers import live_server

API_KEY = "docs-test-key"
HTTP_METHODS = ("get", "put", "post", "delete", "patch", "head", "options")
WAIT_S = 30  # the first render parses ~1.5 MB of JavaScript on a busy 2-core machine

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with live_server(tmp_path_factory.mktemp("server"), SLOT_TRACKER_API_KEY=API_KEY) as url:
        yield url


@pytest.fixture(scope="module")
def browser(chromium: Callable[..., Any]) -> Any:
    return chromium(logs=True)


@pytest.fixture(scope="module")
def document(server: str) -> dict[str, Any]:
    """The OpenAPI document the pages show; the same as the application's own."""
    served = httpx.get(f"{server}/openapi.json").json()
    assert served == create_app(load_settings(api_key=API_KEY, redis_url="")).openapi()
    return served


def operations(doc: dict[str, Any]) -> set[tuple[str, str]]:
    return {(m, p) for p, item in doc["paths"].items() for m in HTTP_METHODS if m in item}


def wait_for(what: str, check: Callable[[], Any]) -> Any:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


def open_page(driver: Any, url: str) -> None:
    driver.get("about:blank")
    driver.get_log("browser")  # start with empty logs
    requested_urls(driver)
    driver.get(url)


def loaded_from_elsewhere(driver: Any, server: str) -> list[str]:
    """URLs the page requested from anywhere but ``server`` (inline data: URIs excepted)."""
    driver.execute_script("window.scrollTo(0, document.body.scrollHeight)")  # lazy images
    timing = driver.execute_script(
        "return performance.getEntriesByType('resource').map((e) => e.name)"
    )
    own = (f"{server}/", f"blob:{server}/", "data:")
    return sorted({u for u in [*requested_urls(driver), *timing] if not u.startswith(own)})


def severe_console(driver: Any) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def test_the_checks_see_a_page_that_loads_from_elsewhere(server: str, browser: Any) -> None:
    """The network and console checks below are not blind: a foreign load is caught.

    The foreign host is 127.0.0.2 (refused at once), so nothing leaves the machine.
    """
    d = browser
    open_page(d, f"{server}/openapi.json")
    d.execute_script(
        "const img = document.createElement('img');"
        "img.src = 'http://127.0.0.2:9/logo.png'; document.body.append(img);"
    )
    wait_for("the failed image", lambda: severe_console(d))
    assert loaded_from_elsewhere(d, server) == ["http://127.0.0.2:9/logo.png"]


def test_swagger_ui_lists_every_operation(
    server: str, browser: Any, document: dict[str, Any]
) -> None:
    d = browser
    expected = operations(document)
    assert len(expected) == 39
    open_page(d, f"{server}/docs")
    read = """
    return [...document.querySelectorAll('#swagger-ui .opblock')].map((op) => [
      op.querySelector('.opblock-summary-method').textContent.toLowerCase(),
      op.querySelector('.opblock-summary-path').dataset.path,
      op.querySelector('.opblock-summary-description').textContent,
    ]);
    """
    shown = wait_for(
        f"{len(expected)} operations in Swagger UI",
        lambda: (ops := d.execute_script(read)) and len(ops) >= len(expected) and ops,
    )
    assert len(shown) == len(expected)
    assert {(m, p) for m, p, _ in shown} == expected
    for method, path, summary in shown:
        assert summary == document["paths"][path][method]["summary"], (method, path)
    title = d.find_element("css selector", "#swagger-ui .info .title").text.split()
    assert title == ["kv-slot-tracker", document["info"]["version"], "OAS", "3.1"]
    # the instance has a key: the bearer scheme is offered
    assert d.find_element("css selector", "#swagger-ui .btn.authorize").is_displayed()
    assert loaded_from_elsewhere(d, server) == []
    assert severe_console(d) == []


def test_redoc_lists_every_operation(server: str, browser: Any, document: dict[str, Any]) -> None:
    d = browser
    label = {"delete": "del"}  # ReDoc's menu badge for DELETE
    expected = {  # grouped by tag in the menu
        f"tag/{item[m]['tags'][0]}/operation/{item[m]['operationId']}": (
            label.get(m, m),
            item[m]["summary"],
        )
        for item in document["paths"].values()
        for m in HTTP_METHODS
        if m in item
    }
    assert len(expected) == 39
    open_page(d, f"{server}/redoc")
    read = """
    return [...document.querySelectorAll('.menu-content li[data-item-id*="/operation/"]')]
      .map((li) => [li.dataset.itemId, li.querySelector('.operation-type').textContent,
                    li.getAttribute('aria-label')]);
    """
    shown = wait_for(
        f"{len(expected)} operations in ReDoc's menu",
        lambda: (ops := d.execute_script(read)) and len(ops) >= len(expected) and ops,
    )
    assert {item: (method, label) for item, method, label in shown} == expected
    assert len(shown) == len(expected)
    heading = d.find_element("css selector", ".api-content h1").text
    assert heading == f"kv-slot-tracker ({document['info']['version']})"
    assert loaded_from_elsewhere(d, server) == []
    assert severe_console(d) == []


def test_swagger_ui_try_it_out_uses_the_key(server: str, browser: Any) -> None:
    """The page talks to the instance itself: with the key entered, ``GET /loads`` answers."""
    d = browser

    def click(css: str) -> None:  # as a user would, wherever the page has scrolled to
        node = wait_for(css, lambda: d.find_elements("css selector", css))[0]
        d.execute_script("arguments[0].click()", node)

    open_page(d, f"{server}/docs#/loads/loads")  # tag/operationId
    wait_for("the /loads operation", lambda: d.find_elements("css selector", ".opblock.is-open"))
    click("#swagger-ui .btn.authorize")
    field = wait_for(
        "the key field", lambda: d.find_elements("css selector", ".auth-container input")
    )[0]
    field.send_keys(API_KEY)
    click(".auth-btn-wrapper .authorize")
    click(".auth-btn-wrapper .btn-done")
    click(".opblock.is-open .try-out__btn")
    click(".opblock.is-open .execute")
    status = wait_for(
        "the answer",
        lambda: d.execute_script(
            "const c = document.querySelector('.opblock.is-open .live-responses-table tr.response "
            ".response-col_status'); return c && c.textContent.trim()"
        ),
    )
    assert status == "200"
    assert loaded_from_elsewhere(d, server) == []
    assert severe_console(d) == []
