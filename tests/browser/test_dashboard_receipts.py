"""The dashboard's routing-decisions panel in a real browser: a real instance (KV events off),
selections made over HTTP with known cached blocks, and headless Chromium reading the page: the
share of decisions that took the most-overlap rank, why the others did not, the blocks given up,
and the predicted against the reported hit rate.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.servers import live_server

from .test_dashboard import wait_for

pytestmark = pytest.mark.browser

READ = """
return [...document.querySelectorAll('#dec-rows tr')].map((row) =>
  [...row.querySelectorAll('td')].map((td) => td.textContent));
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    env = {"SLOT_TRACKER_ROUTER_USE_KV_EVENTS": "false", "DYN_ROUTER_USE_KV_EVENTS": "false"}
    with live_server(tmp_path_factory.mktemp("receipts"), **env) as url:
        yield url


def test_the_page_shows_decision_quality(server: str, chromium: Any) -> None:
    p8 = list(range(1, 9))
    with httpx.Client(base_url=f"{server}/selection") as api:
        for wid in (1, 2):
            body = {"worker_id": wid, "endpoint": f"http://w{wid}", "block_size": 4,
                    "model_name": "m"}  # fmt: skip
            assert api.post("/workers", json=body).status_code == 201
        # worker 1 holds the 8 blocks; a selection of them goes there, a pinned one to 2
        prompt = {"model_name": "m", "block_hashes": p8, "sequence_hashes": p8, "isl_tokens": 32}
        hold = {**prompt, "selection_id": "base", "worker_id": 1}
        assert api.post("/reservations", json=hold).status_code == 201
        r = api.post("/select_and_reserve", json={**prompt, "selection_id": "s1"})
        assert r.json()["worker_id"] == 1
        body = {"cached_tokens": 16}
        assert api.request("DELETE", "/reservations/s1", json=body).status_code == 200
        pinned = {**prompt, "pinned_worker": {"worker_id": 2, "dp_rank": 0}}
        assert api.post("/select", json=pinned).json()["worker_id"] == 2
    d = chromium()
    d.get(f"{server}/dashboard")
    expected = [["m", "default", "2", "50.0 %", "pin 50.0 %", "8", "50.0 %",
                 "50.0 %predicted 100.0 % · 1 report"]]  # fmt: skip
    wait_for(d, "the decisions row", lambda: d.execute_script(READ) == expected)
