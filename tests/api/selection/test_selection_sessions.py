"""Session affinity over HTTP, as observed on the reference with --session-affinity-ttl-secs 2."""

from __future__ import annotations

from typing import Any

import pytest

from tests.api.conftest import running_app
from tests.fakes import FakeClock

T = list(range(40))
U = list(range(100, 140))


@pytest.fixture
async def sessions() -> Any:
    clock = FakeClock()
    async with running_app(clock, router_use_kv_events=False, session_affinity_ttl_seconds=2.0) as (
        _,
        client,
    ):
        yield clock, client


async def post(client: Any, path: str, body: dict) -> Any:
    return await client.post("/selection" + path, json=body)


async def test_a_booking_binds_the_session_to_its_worker(sessions: Any) -> None:
    clock, client = sessions
    for w in (1, 2):
        await post(
            client, "/workers", {"worker_id": w, "endpoint": f"http://w{w}", "block_size": 4}
        )
    r = await post(client, "/select_and_reserve", {"token_ids": T, "session_id": "s"})
    x = r.json()["worker_id"]
    other = 3 - x
    for i in range(5):  # make x the expensive worker
        r = await post(client, "/reservations", {
            "selection_id": f"L{i}", "worker_id": x, "dp_rank": 0, "sequence_hashes": [1000 + i],
            "isl_tokens": 400, "effective_prefill_tokens": 400,
        })  # fmt: skip
        assert r.status_code == 201
    assert (await post(client, "/select", {"token_ids": U})).json()["worker_id"] == other
    assert (await post(client, "/select", {"token_ids": U, "session_id": "s"})).json()[
        "worker_id"
    ] == x
    r = await post(client, "/select_and_reserve", {"token_ids": U, "session_id": "s"})
    assert r.json()["worker_id"] == x
    r = await post(
        client,
        "/select_and_reserve",
        {"token_ids": U, "session_id": "s", "allowed_worker_ids": [other]},
    )
    assert (r.status_code, r.json()) == (
        400, {"error": f"session s is bound to worker {x}, not {other}"},
    )  # fmt: skip
    # a query-only select of a new session binds nothing
    r = await post(client, "/select", {"token_ids": U, "session_id": "q"})
    assert r.json()["worker_id"] == other
    # two seconds after the session's last request it is free again
    clock.advance(1.9)
    assert (await post(client, "/select", {"token_ids": U, "session_id": "s"})).json()[
        "worker_id"
    ] == x
    clock.advance(2.0)
    assert (await post(client, "/select", {"token_ids": U, "session_id": "s"})).json()[
        "worker_id"
    ] == other


async def test_a_session_whose_worker_left_is_chosen_afresh(sessions: Any) -> None:
    _, client = sessions
    for w in (1, 2):
        await post(
            client, "/workers", {"worker_id": w, "endpoint": f"http://w{w}", "block_size": 4}
        )
    x = (await post(client, "/select_and_reserve", {"token_ids": T, "session_id": "s"})).json()[
        "worker_id"
    ]
    await client.delete(f"/selection/workers/{x}")
    r = await post(client, "/select_and_reserve", {"token_ids": T, "session_id": "s"})
    assert (r.status_code, r.json()["worker_id"]) == (200, 3 - x)
    r = await post(client, "/select", {"token_ids": U, "session_id": "s"})
    assert r.json()["worker_id"] == 3 - x
