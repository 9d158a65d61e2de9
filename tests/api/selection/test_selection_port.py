"""``selection_port``: the selection routes at the root of a port of their own, as Dynamo's
selection service serves them on 8092, in the same process and state as ``/selection/*``.

Real sockets (bound here to port 0 and handed to the server, never closed and re-bound), real
HTTP, the server and protocol the command line uses; both the direct path and the ASGI path."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from kv_slot_tracker.__main__ import server_options
from kv_slot_tracker.http.selection import port as selection_port
from kv_slot_tracker.main import create_app
from kv_slot_tracker.settings import load_settings
from tests.servers import run_app

WORKER = {"worker_id": 7, "model_name": "m", "endpoint": "http://w:8000", "block_size": 4}
PROMPT = {"model_name": "m", "token_ids": list(range(12))}


def listening() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


@asynccontextmanager
async def serving(direct: bool, **overrides: Any) -> AsyncIterator[tuple[str, str]]:
    main_sock, sel_sock = listening(), listening()
    main_port, sel_port = main_sock.getsockname()[1], sel_sock.getsockname()[1]
    settings = load_settings(
        port=main_port,
        selection_port=sel_port,
        http_direct=direct,
        router_use_kv_events=False,
        **overrides,
    )
    app = create_app(settings)
    options = {**server_options(settings, app), "log_config": None}
    server = selection_port.server(app, options, sel_port)
    task = asyncio.create_task(server.serve(sockets=[main_sock, sel_sock]))
    try:
        while not server.started:
            assert not task.done(), task
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{main_port}", f"http://127.0.0.1:{sel_port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        main_sock.close()
        sel_sock.close()


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "asgi"])
async def test_selection_routes_at_the_root_share_the_state(direct: bool) -> None:
    async with serving(direct) as (main, sel), httpx.AsyncClient() as c:
        created = await c.post(f"{sel}/workers", json=WORKER)
        assert created.status_code == 201
        assert created.json()["lifecycle"] == "schedulable"
        # the same catalog on the main port, under /selection
        listed = (await c.get(f"{main}/selection/workers")).json()
        assert listed == (await c.get(f"{sel}/workers")).json() == [created.json()]

        picked = await c.post(f"{sel}/select", json=PROMPT)
        assert picked.status_code == 200
        assert picked.json() == (await c.post(f"{main}/selection/select", json=PROMPT)).json()
        assert (picked.json()["worker_id"], picked.json()["effective_prefill_tokens"]) == (7, 12)

        booked = await c.post(f"{sel}/select_and_reserve", json={**PROMPT, "selection_id": "s-1"})
        assert booked.status_code == 200
        loads = (await c.get(f"{sel}/loads")).json()
        assert loads == (await c.get(f"{main}/selection/loads")).json()
        assert loads[0]["loads"][0]["active_requests"] == 1
        # a reservation made on one port is freed on the other (templated lean routes)
        done = await c.post(f"{sel}/reservations/s-1/prefill_complete")
        assert (done.status_code, done.json()) == (200, {"status": "ok"})
        freed = await c.delete(f"{main}/selection/reservations/s-1")
        assert (freed.status_code, freed.json()) == (200, {"status": "ok"})
        again = await c.delete(f"{sel}/reservations/s-1")
        assert again.status_code == 404
        patched = await c.patch(f"{sel}/workers/7", json={"total_kv_blocks": 100})
        assert (patched.status_code, patched.json()["total_kv_blocks"]) == (200, 100)

        # /health and /ready are the selection API's own there, not the slot tracker's
        health = await c.get(f"{sel}/health")
        assert (health.status_code, health.json()) == (200, {"status": "ok"})
        assert (await c.get(f"{main}/health")).content == b""
        assert (await c.get(f"{sel}/ready")).json()["ready"] is True
        assert (await c.get(f"{sel}/replica_sync/peers")).json() == []
        # the main port's /selection/* paths work there too (indexer_peers may name either)
        now = (await c.get(f"{main}/selection/workers")).json()
        assert (await c.get(f"{sel}/selection/workers")).json() == now
        assert now[0]["total_kv_blocks"] == 100
        assert (await c.get(f"{sel}/selection/reservations/s-1")).status_code == 405
        # only the selection routes: no slot-tracker route, no /metrics, no docs
        for method, path in [
            ("GET", "/metrics"),
            ("POST", "/add"),
            ("GET", "/selection"),
            ("GET", "/docs"),
        ]:
            resp = await c.request(method, f"{sel}{path}", json={})
            assert (resp.status_code, resp.json()) == (404, {"error": "route not found"}), path
        # errors are the selection API's
        bad = await c.post(
            f"{sel}/select", content=b"{", headers={"content-type": "application/json"}
        )
        assert bad.status_code == 400
        assert bad.json()["error"].startswith("Failed to parse the request body as JSON: ")
        wrong = await c.put(f"{sel}/select", json={})
        assert (wrong.status_code, wrong.headers["allow"]) == (405, "POST")
        # counted under the selection route's own label on the main port's /metrics
        metrics = (await c.get(f"{main}/metrics")).text
        assert 'handler="/selection/select"' in metrics


async def test_the_api_key_guards_the_selection_port_too() -> None:
    async with serving(True, api_key="k-1") as (_, sel), httpx.AsyncClient() as c:
        assert (await c.post(f"{sel}/workers", json=WORKER)).status_code == 401
        key = {"authorization": "Bearer k-1"}
        assert (await c.post(f"{sel}/workers", json=WORKER, headers=key)).status_code == 201
        assert (await c.post(f"{sel}/select", json=PROMPT)).status_code == 401
        assert (await c.post(f"{sel}/select", json=PROMPT, headers=key)).status_code == 200
        assert (await c.get(f"{sel}/health")).status_code == 200  # open, as /selection/health


def test_a_selection_port_it_cannot_serve_is_refused() -> None:
    with pytest.raises(ValueError, match=r"selection_port \(8092\) must differ from port"):
        load_settings(port=8092, selection_port=8092)
    with pytest.raises(ValueError, match="selection_port is served by one server process"):
        load_settings(port=8091, selection_port=8092, workers=2)
    other = load_settings(port=8091, selection_port=8092, workers="auto")
    assert selection_port.check(other, 1) is None
    assert "workers = auto gives 2" in (selection_port.check(other, 2) or "")
    assert selection_port.check(load_settings(port=8091, workers="auto"), 4) is None


def test_the_command_refuses_it_in_one_check() -> None:
    """--check-config and start-up say the same (exit 2, naming the settings)."""
    for extra in ([], ["--check-config"]):
        done = run_app("--port", "8092", "--selection-port", "8092", *extra)
        assert done.returncode == 2
        assert "selection_port (8092) must differ from port" in done.stderr
