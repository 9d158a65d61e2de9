"""The dashboard's KV-events column in a real browser: a rank whose publisher is connected and
speaking shows as live, one that went quiet as silent, one with nothing at its address (or whose
publisher went away) as disconnected, never as ready.

A real instance with KV events on, a publisher socket in the test's process (the engines'
framing, ``tests/ingest/fake_engine.py``), headless Chromium reading the page.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import zmq

from tests.ingest.fake_engine import BS, FakeEngine, chain
from tests.servers import live_server

from .test_dashboard import wait_for

READ_KV = """
return [...document.querySelectorAll('#sel-rows tr')].map((row) => {
  const cell = row.querySelector('td[data-field="kv-events"]');
  const pills = [...cell.querySelectorAll('.pill')].filter((p) => !p.parentNode.hidden);
  return [row.dataset.model, pills.map((p) => p.textContent), pills.map((p) => p.title)];
});
"""


@pytest.fixture(scope="module")
def kv_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    env = {"SLOT_TRACKER_ROUTER_USE_KV_EVENTS": "true", "DYN_ROUTER_USE_KV_EVENTS": "true",
           "SLOT_TRACKER_KV_EVENTS_SILENT_SECONDS": "3"}  # fmt: skip
    with live_server(tmp_path_factory.mktemp("kv"), **env) as url:
        yield url


def test_publishers_show_as_live_silent_or_disconnected(
    kv_server: str, chromium: Any, tmp_path: Any
) -> None:
    ctx = zmq.Context()
    engine = FakeEngine(ctx, replay=False)
    nowhere = f"ipc://{tmp_path}/nothing-bound-here"
    try:
        with httpx.Client(base_url=f"{kv_server}/selection") as api:
            for wid, endpoint in ((1, engine.endpoint), (2, nowhere)):
                body = {"worker_id": wid, "endpoint": f"http://w{wid}", "block_size": BS,
                        "model_name": "m", "kv_events_endpoint": endpoint}  # fmt: skip
                assert api.post("/workers", json=body).json()["lifecycle"] == "schedulable"
            engine.wait_subscribed()
            d = chromium()
            d.get(f"{kv_server}/dashboard")

            def kv() -> Any:
                return d.execute_script(READ_KV)

            def live_and_disconnected() -> bool:
                engine.publish(chain(1)[0], seq=0)  # keeps a connected publisher speaking
                rows = kv()
                return bool(rows) and rows[0][1:] == [
                    ["1 live", "0 silent", "1 disconnected"],
                    ["worker 1 rank 0", "no rank silent", "worker 2 rank 0"],
                ]

            wait_for(d, "one live publisher, one disconnected", live_and_disconnected)
            wait_for(d, "the quiet publisher as silent", lambda: kv()[0][1][:2] == [
                "0 live", "1 silent"])  # fmt: skip
            engine.close()
            wait_for(d, "both disconnected", lambda: kv()[0][1] == [
                "0 live", "0 silent", "2 disconnected"])  # fmt: skip
    finally:
        engine.close()
        ctx.destroy(linger=0)
