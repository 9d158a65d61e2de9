"""``GET /dashboard`` in a real browser: real instances driven over HTTP, headless Chromium.

Two replicated instances (``python -m kv_slot_tracker`` with Redis and an API key) share a namespace: the
test registers workers and adds and frees requests on the first one, and checks through
Selenium that the page of the second shows the bars appear, grow and shrink, the group history
charts grow and follow the totals, and the replication panel shows the second instance's
``/replication``. An embedded instance checks the key prompt and that it has no such panel.

The test also takes the screenshot ``docs/dashboard.png``; it writes it there only with
``SLOT_TRACKER_UPDATE_SCREENSHOT=1`` (charts, lag and ids differ on every run), and to a
temporary file otherwise:

    SLOT_TRACKER_UPDATE_SCREENSHOT=1 scripts/with_redis.sh .venv/bin/python -m pytest tests/browser

Chromium comes from ``conftest.py`` (the Debian packages; the tests fail without them).
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from selenium.webdriver.support.select import Select

from tests.servers import live_server

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "docs" / "dashboard.png"
API_KEY = "dashboard-test-key"
LLAMA = ("llama-3.1-8b", "default")
MISTRAL = ("mistral-7b", "canary")
BIG_WORKER = 2**53 + 1  # not exactly representable as a JavaScript number
WAIT_S = 15
CHART_H, CHART_PAD = 40, 3  # the charts' viewBox height and padding, as in the page
KEYED = {"Authorization": f"Bearer {API_KEY}"}

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[tuple[str, str]]:
    """Base URLs of two replicated instances in a namespace of their own, both with the key."""
    namespace = f"dashboard-{uuid.uuid4().hex[:8]}"  # short: it shows in the screenshot
    env = {
        "SLOT_TRACKER_API_KEY": API_KEY,
        "SLOT_TRACKER_REDIS_URL": redis_url,
        "SLOT_TRACKER_NAMESPACE": namespace,
    }
    logs = tmp_path_factory.mktemp("replicated")
    try:
        with live_server(logs, **env) as writer, live_server(logs, **env) as reader:
            for url in (writer, reader):
                deadline = time.monotonic() + 30
                while httpx.get(f"{url}/ready").status_code != 200:
                    assert time.monotonic() < deadline, f"{url} did not become ready"
                    time.sleep(0.1)
            yield writer, reader
    finally:
        client = redis.Redis.from_url(redis_url)
        keys = list(client.scan_iter(match="{" + namespace + "}:*"))
        if keys:
            client.delete(*keys)
        client.close()


@pytest.fixture(scope="module")
def server(pair: tuple[str, str]) -> str:
    """The instance whose page is watched; the test's writes reach it through Redis."""
    return pair[1]


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL of a single, embedded instance that requires ``API_KEY``."""
    with live_server(tmp_path_factory.mktemp("embedded"), SLOT_TRACKER_API_KEY=API_KEY) as url:
        yield url


@pytest.fixture(scope="module")
def api(pair: tuple[str, str]) -> Iterator[Callable[[str, dict[str, Any]], None]]:
    """``api(path, body)``: POST to the other instance with the key; 200/201 or the test fails."""
    client = httpx.Client(base_url=pair[0], headers=KEYED)

    def post(path: str, body: dict[str, Any]) -> None:
        resp = client.post(path, json=body)
        assert resp.status_code in (200, 201), (path, body, resp.status_code, resp.text)

    try:
        yield post
    finally:
        client.close()


@pytest.fixture(scope="module")
def browser(chromium: Callable[..., Any]) -> Any:
    return chromium()


# --- reading the page ----------------------------------------------------------------------

READ_GROUP = """
const [model, group] = arguments;
const node = [...document.querySelectorAll("section.group")].find(
  (s) => s.dataset.model === model && s.dataset.routingGroup === group);
if (!node) return null;
return [...node.querySelectorAll(".row.rank")].map((row) => ({
  worker: row.dataset.workerId,
  dp: Number(row.dataset.dpRank),
  label: [...row.querySelectorAll(".label > span")].map((s) => s.textContent).join(" | "),
  metrics: Object.fromEntries([...row.querySelectorAll(".metric")].map((cell) => {
    const bar = cell.querySelector(".bar");
    return [cell.dataset.metric, {
      text: cell.querySelector(".num").textContent,
      pct: parseFloat(bar.style.width) || 0,
      px: bar.getBoundingClientRect().width,
      trackPx: bar.parentElement.getBoundingClientRect().width,
      transition: getComputedStyle(bar).transitionDuration,
    }];
  })),
}));
"""


def read_group(driver: Any, key: tuple[str, str]) -> dict[tuple[str, int], dict] | None:
    rows = driver.execute_script(READ_GROUP, *key)
    if rows is None:
        return None
    return {(r["worker"], r["dp"]): r for r in rows}


def rank_order(driver: Any, key: tuple[str, str]) -> list[tuple[str, int]]:
    return list(read_group(driver, key) or {})


def wait_for(driver: Any, what: str, check: Callable[[], bool]) -> None:
    """Poll ``check`` until it holds (the page refreshes every second); fail with ``what``."""
    deadline = time.monotonic() + WAIT_S
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
            last_error = None
        except (KeyError, TypeError, AssertionError) as exc:
            last_error = exc
        time.sleep(0.1)
    state = {
        "body": driver.execute_script("return document.body.dataset.state"),
        "notice": driver.execute_script("return document.getElementById('notice').textContent"),
        "llama": read_group(driver, LLAMA),
    }
    pytest.fail(f"timed out waiting for: {what} (last error: {last_error!r}); page: {state}")


def metric(driver: Any, key: tuple[str, str], worker: int, dp: int, name: str) -> dict:
    return read_group(driver, key)[(str(worker), dp)]["metrics"][name]


def bars_match_numbers(driver: Any, key: tuple[str, str]) -> None:
    """Every bar of the group is as wide as its value of the group's maximum, right now.

    Read in one go right after a refresh: a bar that still moved towards its value (a width
    transition) would be off here.
    """
    rows = read_group(driver, key) or {}
    for rank, row in rows.items():
        values = {name: int(m["text"].replace(",", "")) for name, m in row["metrics"].items()}
        for name, m in row["metrics"].items():
            assert m["transition"] == "0s", (rank, name, m["transition"])
            top = max(int(r["metrics"][name]["text"].replace(",", "")) for r in rows.values())
            want = m["trackPx"] * values[name] / top if top else 0
            if values[name] > 0 and want < 3:
                want = 3  # the smallest visible bar
            assert abs(m["px"] - want) <= 1, (rank, name, m["px"], want)


def shows(driver: Any, worker: int, dp: int, *, blocks: int, prefill: int, requests: int) -> bool:
    m = read_group(driver, LLAMA)[(str(worker), dp)]["metrics"]
    return (
        m["active_decode_blocks"]["text"] == f"{blocks:,}"
        and m["active_prefill_tokens"]["text"] == f"{prefill:,}"
        and m["active_requests"]["text"] == f"{requests:,}"
    )


def column(driver: Any, key: tuple[str, str], name: str) -> list[int]:
    """The numbers shown for one metric, in the order of the rows."""
    rows = read_group(driver, key) or {}
    return [int(r["metrics"][name]["text"].replace(",", "")) for r in rows.values()]


def control_state(driver: Any) -> dict[str, Any]:
    """The sort and idle controls, and the address's query."""
    return driver.execute_script(
        """return {sort: document.getElementById("sort").value,
                   hideIdle: document.getElementById("hide-idle").checked,
                   query: location.search};"""
    )


def idle_note(driver: Any, key: tuple[str, str]) -> list[str]:
    """A group header's note on hidden idle ranks, and their count."""
    return driver.execute_script(
        """const [model, group] = arguments;
        const node = [...document.querySelectorAll("section.group")].find(
          (s) => s.dataset.model === model && s.dataset.routingGroup === group);
        return [node.querySelector(".idle-note").textContent, node.dataset.hiddenIdle];""",
        *key,
    )


SEL_MAIN = {"model_name": "qwen-2.5-7b", "routing_group": "default"}
SEL_CANARY = {"model_name": "qwen-2.5-7b", "routing_group": "canary"}
MAIN_KEY, CANARY_KEY = "qwen-2.5-7b/default", "qwen-2.5-7b/canary"
SEL_BOOKED = 3  # reservations the selection test leaves booked (they show in the screenshot)

READ_SELECTION = """
const texts = arguments[0];
return [...document.querySelectorAll("#sel-rows > tr")].map((row) => {
  const pill = (lc) => row.querySelector(`.pill[data-lifecycle="${lc}"]`);
  const cell = (f) => row.querySelector(`td[data-field="${f}"]`);
  const out = {
    key: row.dataset.model + "/" + row.dataset.routingGroup,
    schedulable: Number(pill("schedulable").dataset.count),
    incomplete: Number(pill("incomplete").dataset.count),
    unschedulable: Number(pill("unschedulable").dataset.count),
    reservations: Number(cell("reservations").dataset.value),
    pending: Number(cell("pending").dataset.value),
    pending_tokens: Number(cell("pending").querySelector(".sub").dataset.value),
    prefill: Number(cell("prefill").dataset.value),
    decode: Number(cell("decode").dataset.value),
  };
  if (texts) {
    out.texts = [pill("schedulable"), pill("incomplete"), pill("unschedulable"),
                 cell("reservations"), cell("prefill"), cell("decode")].map((n) => n.textContent);
    out.incompleteTitle = pill("incomplete").title;
  }
  return out;
});
"""


def read_selection(driver: Any, *, texts: bool = False) -> dict[str, dict[str, Any]]:
    """The selection section's rows, by "model/group", as counts (and texts)."""
    rows = driver.execute_script(READ_SELECTION, texts)
    shown = {r.pop("key"): r for r in rows}
    if texts:
        for r in shown.values():  # the numbers as shown agree with the values read
            assert r["texts"][3:] == [f"{r[f]:,}" for f in ("reservations", "prefill", "decode")]
    return shown


def selection_answers(client: httpx.Client, *, reservations: int) -> dict[str, dict[str, int]]:
    """What the section should show, per partition, from the instance's own answers.

    Waits until the instance holds ``reservations`` bookings in all (the writes replicate).
    """
    deadline = time.monotonic() + WAIT_S
    while True:
        loads = client.get("/loads").json()
        workers = client.get("/workers").json()
        booked = sum(r["active_requests"] for p in loads for r in p["loads"])
        if booked == reservations and len(workers) == 3:
            break
        assert time.monotonic() < deadline, (loads, workers)
        time.sleep(0.1)
    out: dict[str, dict[str, int]] = {}
    for p in loads:
        out[f"{p['model_name']}/{p['routing_group']}"] = {
            "schedulable": 0,
            "incomplete": 0,
            "unschedulable": 0,
            "reservations": sum(r["active_requests"] for r in p["loads"]),
            "pending": p["pending_count"],
            "pending_tokens": p["pending_isl_tokens"],
            "prefill": sum(r["potential_prefill_tokens"] for r in p["loads"]),
            "decode": sum(r["potential_decode_blocks"] for r in p["loads"]),
        }
    for w in workers:
        out[f"{w['model_name']}/{w['routing_group']}"][w["lifecycle"]] += 1
    return out


def text_of(driver: Any, element_id: str) -> str:
    return driver.execute_script(f"return document.getElementById('{element_id}').textContent")


def visible(driver: Any, element_id: str) -> bool:
    return driver.find_element("id", element_id).is_displayed()


READ_HISTORY = """
const [model, group, field] = arguments;
const node = [...document.querySelectorAll("section.group")].find(
  (s) => s.dataset.model === model && s.dataset.routingGroup === group);
const svg = node && node.querySelector(`.row.history .spark[data-metric="${field}"] svg`);
if (!svg) return null;
return {
  line: svg.querySelector(".line").getAttribute("d") || "",
  points: Number(svg.dataset.points),
  peak: Number(svg.dataset.peak),
  last: Number(svg.dataset.last),
  shown: svg.closest(".spark").querySelector(".num").textContent,
  peakText: svg.closest(".spark").querySelector(".peak").textContent,
};
"""


HISTORY_TEXT = "since the page opened, at most the last 5 minutes"


def chart_span(driver: Any, key: tuple[str, str]) -> dict[str, Any]:
    """What a group's charts say they cover, the footer's words, and the page's age in s."""
    return driver.execute_script(
        """
        const [model, group] = arguments;
        const node = [...document.querySelectorAll("section.group")].find(
          (s) => s.dataset.model === model && s.dataset.routingGroup === group);
        const span = node.querySelector(".row.history .span");
        return {text: span.textContent, title: span.title, age: performance.now() / 1000,
                footer: document.querySelector("footer").textContent.replace(/\\s+/g, " ")};
        """,
        *key,
    )


def history(driver: Any, key: tuple[str, str], name: str) -> dict[str, Any]:
    """One chart of a group's history, with the points of its line as (x, y) pairs."""
    h = driver.execute_script(READ_HISTORY, *key, name)
    assert h is not None, (key, name)
    h["xy"] = [(float(x), float(y)) for x, y in re.findall(r"([\d.]+),([\d.]+)", h["line"])]
    return h


def chart_y(value: int, peak: int) -> float:
    """Where the page draws ``value`` on a chart whose peak is ``peak`` (2 decimals)."""
    return round(CHART_H - CHART_PAD - (CHART_H - 2 * CHART_PAD) * value / (peak or 1), 2)


def total(driver: Any, key: tuple[str, str], name: str) -> int:
    """The group total of one metric, summed from the numbers beside the bars."""
    rows = read_group(driver, key) or {}
    return sum(int(r["metrics"][name]["text"].replace(",", "")) for r in rows.values())


def panel(driver: Any) -> dict[str, Any]:
    """The replication panel: whether it shows, its mode and each field's text and value."""
    return driver.execute_script(
        """
        const p = document.getElementById("replication");
        const f = (id) => [document.getElementById(id).textContent,
                           document.getElementById(id).dataset.value];
        return {visible: p.getBoundingClientRect().height > 0 && !p.hidden, mode: p.dataset.mode,
                connected: f("repl-connected"), lag: f("repl-lag"), outbox: f("repl-outbox"),
                position: f("repl-position"), health: f("repl-degraded"),
                modeText: f("repl-mode")[0], facts: document.getElementById("repl-facts").textContent};
        """
    )


def save_screenshot(driver: Any) -> None:
    """Write the whole page, at its natural height, to ``docs/dashboard.png`` (see above)."""
    height = driver.execute_script(
        "return Math.ceil(document.querySelector('footer').getBoundingClientRect().bottom)"
    )
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": 1280, "height": int(height), "deviceScaleFactor": 1, "mobile": False},
    )
    try:
        time.sleep(0.7)  # a refresh at the new size
        if os.environ.get("SLOT_TRACKER_UPDATE_SCREENSHOT") == "1":
            path = SCREENSHOT
        else:
            path = Path(driver.capabilities["chrome"]["userDataDir"]) / SCREENSHOT.name
        path.parent.mkdir(parents=True, exist_ok=True)
        assert driver.save_screenshot(str(path)), "screenshot failed"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


# --- the tests -----------------------------------------------------------------------------


def test_dashboard_html_is_open_and_api_stays_protected(server: str) -> None:
    page = httpx.get(f"{server}/dashboard")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert page.headers["referrer-policy"] == "no-referrer"
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert "<title>kv-slot-tracker" in page.text
    # self-contained: nothing is loaded from another origin
    assert "http://" not in page.text and "https://" not in page.text
    assert httpx.head(f"{server}/dashboard").status_code == 200
    assert httpx.get(f"{server}/loads").status_code == 401
    doc = httpx.get(f"{server}/openapi.json").json()
    assert "/dashboard" not in doc["paths"]


def test_selection_section(pair: tuple[str, str], server: str, browser: Any) -> None:
    """The selection section follows ``/selection/workers`` and ``/selection/loads``."""
    d = browser
    d.get(f"{server}/dashboard?key={API_KEY}")
    wait_for(
        d,
        "the page to load /loads",
        lambda: d.find_element("tag name", "body").get_attribute("data-state") == "live",
    )
    assert "key=" not in d.current_url, "the key must be removed from the address bar"
    # Nothing registered yet: the empty-state message, and no selection section.
    wait_for(d, "the empty-state message", lambda: visible(d, "empty"))
    assert "No worker ranks registered yet" in text_of(d, "empty")
    assert not visible(d, "selection")

    with (
        httpx.Client(base_url=f"{pair[0]}/selection", headers=KEYED) as writer,
        httpx.Client(base_url=f"{server}/selection", headers=KEYED) as reader,
    ):

        def call(method: str, path: str, body: dict[str, Any] | None = None) -> Any:
            resp = writer.request(method, path, json=body)
            assert resp.status_code in (200, 201), (method, path, resp.status_code, resp.text)
            return resp.json()

        # Schedulable in either routing mode: an endpoint and a KV events endpoint.
        reachable = {"endpoint": "http://10.0.0.71:8000", "kv_events_endpoint": "tcp://127.0.0.1:9"}
        call("POST", "/workers", {**SEL_MAIN, "worker_id": 71, **reachable, "block_size": 16,
                                  "data_parallel_size": 2})  # fmt: skip
        incomplete = call("POST", "/workers", {**SEL_MAIN, "worker_id": 72, "block_size": 16})
        assert incomplete["lifecycle"] == "incomplete"
        assert incomplete["not_schedulable_reasons"] == ["endpoint is required"]
        call("POST", "/workers", {**SEL_CANARY, "worker_id": 73, **reachable, "block_size": 16})
        for sid, n, where in [("s1", 40, SEL_MAIN), ("s2", 64, SEL_MAIN), ("s3", 24, SEL_MAIN),
                              ("s4", 33, SEL_CANARY)]:  # fmt: skip
            body = {"model_name": where["model_name"], "routing_group": where["routing_group"],
                    "selection_id": sid, "token_ids": list(range(n * 10, n * 11))}  # fmt: skip
            assert call("POST", "/select_and_reserve", body)["selection_id"] == sid

        expected = selection_answers(reader, reservations=4)
        assert expected[MAIN_KEY]["schedulable"] == 1 and expected[MAIN_KEY]["incomplete"] == 1
        assert expected[MAIN_KEY]["reservations"] == 3 and expected[CANARY_KEY]["reservations"] == 1
        assert expected[MAIN_KEY]["prefill"] == 40 + 64 + 24
        wait_for(d, "the selection section", lambda: read_selection(d) == expected)
        assert visible(d, "selection")
        rows = read_selection(d, texts=True)
        assert rows[MAIN_KEY]["texts"][:4] == [
            "1 schedulable",
            "1 incomplete",
            "0 unschedulable",
            "3",
        ]
        assert rows[MAIN_KEY]["incompleteTitle"] == "worker 72: endpoint is required"
        assert rows[CANARY_KEY]["texts"][:4] == [
            "1 schedulable",
            "0 incomplete",
            "0 unschedulable",
            "1",
        ]
        assert list(rows) == [CANARY_KEY, MAIN_KEY]  # sorted by model, then group
        assert "2 partitions · 3 workers" in text_of(d, "sel-facts")

        # A reservation freed: its partition's counts follow.
        call("DELETE", "/reservations/s2")
        after = selection_answers(reader, reservations=3)
        assert after[MAIN_KEY]["reservations"] == 2
        assert after[MAIN_KEY]["prefill"] == expected[MAIN_KEY]["prefill"] - 64
        assert after[CANARY_KEY] == expected[CANARY_KEY]
        wait_for(d, "the freed reservation", lambda: read_selection(d) == after)
        assert sum(p["reservations"] for p in after.values()) == SEL_BOOKED


def test_bars_follow_the_load(server: str, api: Callable, browser: Any) -> None:
    d = browser
    d.get(f"{server}/dashboard?key={API_KEY}")
    wait_for(
        d,
        "the page to load /loads",
        lambda: d.find_element("tag name", "body").get_attribute("data-state") == "live",
    )
    assert "key=" not in d.current_url, "the key must be removed from the address bar"
    wait_for(d, "readiness in the header", lambda: text_of(d, "ready") == "ready")
    assert text_of(d, "mode").startswith("redis")
    wait_for(d, "the replication panel", lambda: panel(d)["visible"])
    assert panel(d)["mode"] == "redis"

    # Registered out of order: the page sorts ranks by worker id, then dp rank.
    llama, mistral = (
        dict(zip(("model_name", "routing_group"), LLAMA, strict=True)),
        dict(zip(("model_name", "routing_group"), MISTRAL, strict=True)),
    )
    api("/register", {**llama, "worker_id": 2, "block_size": 16, "dp_start": 0, "dp_size": 1})
    api("/register", {**llama, "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 2})
    api(
        "/register",
        {**mistral, "worker_id": BIG_WORKER, "block_size": 32, "dp_start": 0, "dp_size": 2},
    )
    wait_for(
        d,
        "three sorted llama ranks",
        lambda: rank_order(d, LLAMA) == [("1", 0), ("1", 1), ("2", 0)],
    )
    assert not visible(d, "empty")
    for rank in [(1, 0), (1, 1), (2, 0)]:
        assert shows(d, *rank, blocks=0, prefill=0, requests=0)
        assert metric(d, LLAMA, *rank, "active_decode_blocks")["px"] == 0
    wait_for(
        d,
        "the mistral group",
        lambda: rank_order(d, MISTRAL) == [(str(BIG_WORKER), 0), (str(BIG_WORKER), 1)],
    )
    labels = [r["label"] for r in read_group(d, MISTRAL).values()]
    assert labels == [f"worker {BIG_WORKER} | dp 0", f"worker {BIG_WORKER} | dp 1"], labels

    # The group's history starts as soon as it appears: idle, every point on the baseline.
    wait_for(d, "two idle samples", lambda: history(d, LLAMA, "active_requests")["points"] >= 2)
    idle = history(d, LLAMA, "active_requests")
    assert (idle["peak"], idle["last"], idle["shown"], idle["peakText"]) == (0, 0, "0", "peak 0")
    assert {y for _, y in idle["xy"]} == {chart_y(0, 0)}
    # The charts say what they cover as the footer does: the time since the page opened.
    span = chart_span(d, LLAMA)
    assert HISTORY_TEXT in span["footer"], span
    assert span["title"] == f"The charts cover the time {HISTORY_TEXT}.", span
    shown = re.fullmatch(r"since the page opened \((\d+) s\)", span["text"])
    assert shown, span
    assert span["age"] - 5 <= int(shown[1]) <= span["age"] + 1, span  # a refresh may be late

    # One request on worker 1 / dp 0: its bars appear, at full scale.
    api(
        "/add",
        {
            **llama,
            "request_id": "a1",
            "worker_id": 1,
            "dp_rank": 0,
            "sequence_hashes": [1, 2, 3, 4],
            "new_isl_tokens": 64,
        },
    )
    wait_for(d, "a1 on 1/0", lambda: shows(d, 1, 0, blocks=4, prefill=64, requests=1))
    bars_match_numbers(d, LLAMA)  # at once, not after an animation
    wait_for(
        d,
        "1/0 blocks bar at full width",
        lambda: metric(d, LLAMA, 1, 0, "active_decode_blocks")["pct"] == 100,
    )
    # ... and the history follows: the newest point, at the right edge, is the new peak, and
    # the line grows by a point with every refresh.
    wait_for(d, "a1 in the history", lambda: history(d, LLAMA, "active_requests")["last"] == 1)
    h = history(d, LLAMA, "active_requests")
    assert (h["peak"], h["shown"], h["peakText"]) == (1, "1", "peak 1")
    assert h["xy"][-1] == (300.0, chart_y(1, 1)) == (300.0, 3.0)
    assert len(h["xy"]) == h["points"]
    assert all(x1 < x2 for (x1, _), (x2, _) in zip(h["xy"], h["xy"][1:], strict=False))
    blocks = history(d, LLAMA, "active_decode_blocks")
    assert (blocks["last"], blocks["peak"], blocks["shown"]) == (4, 4, "4")
    grown = h["points"] + 3
    wait_for(
        d,
        "three more points in the line",
        lambda: len(history(d, LLAMA, "active_requests")["xy"]) >= grown,
    )
    assert shows(d, 2, 0, blocks=0, prefill=0, requests=0)

    # Two bigger requests on worker 2: its bars grow from nothing past worker 1's,
    # which keeps its numbers but now sits lower on the shared scale.
    before = metric(d, LLAMA, 2, 0, "active_decode_blocks")["px"]
    api(
        "/add",
        {
            **llama,
            "request_id": "b1",
            "worker_id": 2,
            "dp_rank": 0,
            "sequence_hashes": list(range(101, 109)),
            "new_isl_tokens": 256,
        },
    )
    api(
        "/add",
        {
            **llama,
            "request_id": "b2",
            "worker_id": 2,
            "dp_rank": 0,
            "sequence_hashes": [101, 102, 103, 104, 201, 202, 203, 204],
            "new_isl_tokens": 128,
        },
    )
    wait_for(d, "b1+b2 on 2/0", lambda: shows(d, 2, 0, blocks=12, prefill=384, requests=2))
    bars_match_numbers(d, LLAMA)
    wait_for(
        d,
        "2/0 bars grown to full width",
        lambda: (
            metric(d, LLAMA, 2, 0, "active_decode_blocks")["px"]
            > max(before, metric(d, LLAMA, 1, 0, "active_decode_blocks")["px"]) * 2.5
        ),
    )
    assert metric(d, LLAMA, 2, 0, "active_decode_blocks")["pct"] == 100
    assert round(metric(d, LLAMA, 1, 0, "active_decode_blocks")["pct"], 1) == 33.3
    assert round(metric(d, LLAMA, 1, 0, "active_prefill_tokens")["pct"], 1) == 16.7
    assert metric(d, LLAMA, 1, 0, "active_requests")["pct"] == 50
    assert shows(d, 1, 0, blocks=4, prefill=64, requests=1)
    # the group totals in the history are the sums of the bars: 4 + 12 blocks, 64 + 384 tokens
    expected = {"active_requests": 3, "active_decode_blocks": 16, "active_prefill_tokens": 448}
    wait_for(
        d,
        "b1+b2 in the history",
        lambda: {name: history(d, LLAMA, name)["last"] for name in expected} == expected,
    )
    for name, value in expected.items():
        assert total(d, LLAMA, name) == value
        h = history(d, LLAMA, name)
        assert (h["peak"], h["shown"]) == (value, f"{value:,}")
        assert h["xy"][-1] == (300.0, chart_y(value, value))

    # Prefill done for a1: its prefill bar empties, its blocks stay.
    api("/prefill_complete", {**llama, "request_id": "a1"})
    wait_for(d, "a1 prefill done", lambda: shows(d, 1, 0, blocks=4, prefill=0, requests=1))
    wait_for(
        d,
        "1/0 prefill bar empty",
        lambda: metric(d, LLAMA, 1, 0, "active_prefill_tokens")["px"] == 0,
    )

    # Fill in the rest for the screenshot: worker 1 / dp 1, and the mistral ranks, where dp 0
    # has modeled prefill durations (the page shows the time left). The first, anchor request
    # there is small, so its decay does not change the numbers shown for half a minute: the
    # screenshot comes out the same on every run.
    api(
        "/add",
        {
            **llama,
            "request_id": "c1",
            "worker_id": 1,
            "dp_rank": 1,
            "sequence_hashes": [301, 302, 303, 304, 305, 306],
            "new_isl_tokens": 96,
        },
    )
    for i, (dp, n, tokens, ms) in enumerate(
        [(0, 22, 16, 600_000), (0, 14, 880, 600_000), (1, 9, 360, None)]
    ):
        api(
            "/add",
            {
                **mistral,
                "request_id": f"m{i}",
                "worker_id": BIG_WORKER,
                "dp_rank": dp,
                "sequence_hashes": list(range(1000 * (i + 1), 1000 * (i + 1) + n)),
                "new_isl_tokens": tokens,
                "expected_prefill_ms": ms,
            },
        )
    wait_for(d, "c1 on 1/1", lambda: shows(d, 1, 1, blocks=6, prefill=96, requests=1))
    wait_for(
        d,
        "mistral loads",
        lambda: (
            [r["metrics"]["active_requests"]["text"] for r in read_group(d, MISTRAL).values()]
            == ["2", "1"]
        ),
    )
    assert text_of(d, "sum-requests") == str(7 + SEL_BOOKED)  # and the selection test's
    etas = d.execute_script(
        "return [...document.querySelectorAll("
        "'section.group[data-model=\"mistral-7b\"] .row.rank .eta')]"
        ".map((e) => e.textContent)"
    )
    assert etas == ["~20 min", ""], etas
    assert metric(d, MISTRAL, BIG_WORKER, 0, "active_prefill_tokens")["text"] == "896"

    # The replication panel shows this instance's /replication: connected, nothing to publish
    # (the writes went to the other instance), and the position and lag of what it applied.
    with httpx.Client(base_url=server, headers=KEYED) as client:
        status = client.get("/replication").json()
        capacity = status["outbox_capacity"]
        assert status["mode"] == "redis" and status["connected"] is True
        assert status["outbox_depth"] == 0 and capacity > 0
        assert status["stream_position"] and status["last_applied_lag_ms"] is not None
        assert status["degraded_reasons"] == []
        wait_for(
            d,
            "the panel at the last stream position",
            lambda: panel(d)["position"] == [status["stream_position"]] * 2,
        )
        assert client.get("/replication").json()["stream_position"] == status["stream_position"]
    shown = panel(d)
    assert shown["visible"] and shown["mode"] == "redis" and shown["modeText"] == "redis"
    assert shown["connected"] == ["connected", "true"]
    assert shown["outbox"] == [f"0 / {capacity:,}", "0"]
    assert float(shown["lag"][1]) == status["last_applied_lag_ms"]
    assert re.fullmatch(r"[\d,.]+ m?s", shown["lag"][0]), shown["lag"]
    assert shown["health"] == ["healthy", ""]
    assert f"instance {status['instance_id']}" in shown["facts"]
    assert f"namespace {status['namespace']}" in shown["facts"]
    save_screenshot(d)

    # Worker 2's requests end: its bars shrink to nothing and worker 1 is the full scale again.
    api("/free", {**llama, "request_id": "b1"})
    wait_for(d, "b1 freed", lambda: shows(d, 2, 0, blocks=8, prefill=128, requests=1))
    api("/free", {**llama, "request_id": "b2"})
    wait_for(d, "b2 freed", lambda: shows(d, 2, 0, blocks=0, prefill=0, requests=0))
    bars_match_numbers(d, LLAMA)
    wait_for(
        d, "2/0 blocks bar empty", lambda: metric(d, LLAMA, 2, 0, "active_decode_blocks")["px"] == 0
    )
    wait_for(
        d,
        "1/1 blocks bar at full width",
        lambda: metric(d, LLAMA, 1, 1, "active_decode_blocks")["pct"] == 100,
    )
    assert round(metric(d, LLAMA, 1, 0, "active_decode_blocks")["pct"], 1) == 66.7
    # the history keeps the peak: 2 requests now (a1, c1), 4 at most (with b1, b2) before
    wait_for(
        d, "the frees in the history", lambda: history(d, LLAMA, "active_requests")["last"] == 2
    )
    h = history(d, LLAMA, "active_requests")
    assert (h["peak"], h["shown"], h["peakText"]) == (4, "2", "peak 4")
    assert h["xy"][-1] == (300.0, chart_y(2, 4)) == (300.0, 20.0)
    assert max(y for _, y in h["xy"]) == chart_y(0, 4)  # it started idle
    assert min(y for _, y in h["xy"]) == chart_y(4, 4)

    # Sorting and hiding idle ranks, kept in the address. Worker 2 is idle now (all three 0).
    assert control_state(d) == {"sort": "worker", "hideIdle": False, "query": ""}
    Select(d.find_element("id", "sort")).select_by_value("blocks")
    wait_for(d, "sorted by blocks", lambda: rank_order(d, LLAMA) == [("1", 1), ("1", 0), ("2", 0)])
    assert column(d, LLAMA, "active_decode_blocks") == [6, 4, 0]  # the numbers shown, descending
    assert control_state(d)["query"] == "?sort=blocks"
    Select(d.find_element("id", "sort")).select_by_value("prefill")
    wait_for(d, "sorted by prefill", lambda: rank_order(d, LLAMA) == [("1", 1), ("1", 0), ("2", 0)])
    assert column(d, LLAMA, "active_prefill_tokens") == [96, 0, 0]
    d.find_element("id", "hide-idle").click()
    wait_for(d, "idle ranks hidden", lambda: rank_order(d, LLAMA) == [("1", 1), ("1", 0)])
    assert control_state(d)["query"] == "?sort=prefill&idle=hide"
    assert idle_note(d, LLAMA) == ["1 idle rank hidden", "1"]
    assert idle_note(d, MISTRAL) == ["", "0"]  # both mistral ranks are busy
    assert len(read_group(d, MISTRAL)) == 2
    # The choice survives a reload, also with a key in the address (which still goes away).
    d.get(f"{server}/dashboard?sort=blocks&key={API_KEY}&idle=hide")
    wait_for(d, "the reloaded page", lambda: rank_order(d, LLAMA) == [("1", 1), ("1", 0)])
    assert control_state(d) == {
        "sort": "blocks",
        "hideIdle": True,
        "query": "?sort=blocks&idle=hide",
    }
    assert column(d, LLAMA, "active_decode_blocks") == [6, 4]
    assert idle_note(d, LLAMA) == ["1 idle rank hidden", "1"]
    # A request on the idle rank shows it again, sorted in by its blocks; freed, it hides again.
    api(
        "/add",
        {
            **llama,
            "request_id": "d1",
            "worker_id": 2,
            "dp_rank": 0,
            "sequence_hashes": [401, 402, 403, 404, 405],
            "new_isl_tokens": 80,
        },
    )
    wait_for(d, "2/0 back, between", lambda: rank_order(d, LLAMA) == [("1", 1), ("2", 0), ("1", 0)])
    assert column(d, LLAMA, "active_decode_blocks") == [6, 5, 4]
    assert idle_note(d, LLAMA) == ["", "0"]
    bars_match_numbers(d, LLAMA)
    api("/free", {**llama, "request_id": "d1"})
    wait_for(d, "2/0 hidden again", lambda: rank_order(d, LLAMA) == [("1", 1), ("1", 0)])
    d.find_element("id", "hide-idle").click()
    Select(d.find_element("id", "sort")).select_by_value("worker")
    wait_for(
        d, "worker order again", lambda: rank_order(d, LLAMA) == [("1", 0), ("1", 1), ("2", 0)]
    )
    assert control_state(d)["query"] == ""
    assert idle_note(d, LLAMA) == ["", "0"]

    # A worker that goes away takes its row with it.
    api("/unregister", {**llama, "worker_id": 2})
    wait_for(d, "worker 2 gone", lambda: rank_order(d, LLAMA) == [("1", 0), ("1", 1)])


def test_page_asks_for_the_key(embedded: str, browser: Any) -> None:
    """On an embedded instance, which also shows no replication panel."""
    d = browser
    resp = httpx.post(
        f"{embedded}/register",
        json={
            "model_name": "key-check",
            "worker_id": 5,
            "block_size": 16,
            "dp_start": 0,
            "dp_size": 1,
        },
        headers=KEYED,
    )
    assert resp.status_code == 201, resp.text
    d.get(f"{embedded}/dashboard")
    d.execute_script("sessionStorage.clear()")
    d.refresh()
    body = lambda: d.find_element("tag name", "body").get_attribute("data-state")  # noqa: E731
    wait_for(d, "the key prompt", lambda: body() == "needs-key" and visible(d, "keyform"))
    assert "needs an API key" in text_of(d, "notice")
    assert "key needed" in text_of(d, "mode")
    assert text_of(d, "ready") == "ready"  # /ready is open
    assert not panel(d)["visible"]

    field = d.find_element("id", "keyinput")
    field.send_keys("wrong-key")
    d.find_element("id", "keysave").click()
    wait_for(d, "the wrong key refused", lambda: "not accepted" in text_of(d, "notice"))
    assert body() == "needs-key"

    field.send_keys(API_KEY)
    d.find_element("id", "keysave").click()
    wait_for(
        d,
        "data with the right key",
        lambda: body() == "live" and read_group(d, ("key-check", "default")) is not None,
    )
    assert not visible(d, "keyform")
    assert d.execute_script("return sessionStorage.getItem('kv-slot-tracker.api-key')") == API_KEY
    # embedded: the header says so, and there is no replication panel
    wait_for(d, "the mode with the key", lambda: "embedded" in text_of(d, "mode"))
    assert panel(d)["mode"] == "embedded" and not panel(d)["visible"]
    assert not visible(d, "selection")  # no selection partition here
    assert not visible(d, "replication")

    d.find_element("id", "keyclear").click()
    wait_for(d, "the key forgotten", lambda: body() == "needs-key")
    assert d.execute_script("return sessionStorage.getItem('kv-slot-tracker.api-key')") is None
