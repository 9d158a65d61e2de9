"""A routing receipt's outcome from the calls a router makes after the decision, over HTTP.

* The slot tracker's ``/prefill_complete`` and ``/free`` (and the same ops in ``/batch``) take an
  optional ``cached_tokens``: it goes to the receipt of the selection whose id is the request id,
  in the same model and routing group. Without it the calls answer as before, byte for byte.
* A ``/selection/select`` followed by an explicit booking (``POST /selection/reservations`` with
  a ``worker_id``) of the chosen rank: the receipt is booked and followed as a
  ``select_and_reserve``'s.

Workers A=1, B=2, block size 4, KV events off, A holding P8 (``holds_p8``): the §4 query of the
first 3 blocks of P8 then 5 new ones (isl 32) costs 18 on A and 16 on B, so B is chosen with 0 of
the 3 cached blocks (predicted cached tokens 0); P8 itself goes to A with 8 blocks (32 tokens).
"""

from __future__ import annotations

from typing import Any

import pytest

from kv_slot_tracker.http.fast_bodies import path_of
from tests.api.conftest import post_json
from tests.api.selection.helpers import P8, SEL, A, B, add_worker, holds_p8, post, prompt
from tests.api.selection.test_receipts import metrics, receipt, s1

DEFAULT = {"model_name": "default"}


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    return {"selection_seed": 7}


async def two_workers(client) -> None:
    await add_worker(client, A)
    await add_worker(client, B)
    await holds_p8(client)


async def call(client, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    r = await post_json(client, path, body)
    return r.status_code, r.content


async def add(client, rid: str, worker_id: int, blocks: list[int]) -> None:
    """The router books the request itself, through the slot tracker."""
    body = {**DEFAULT, "request_id": rid, "worker_id": worker_id, "dp_rank": 0, "sequence_hashes": blocks,
            "new_isl_tokens": 32}  # fmt: skip
    assert await call(client, "/add", body) == (201, b'{"status":"ok"}')


async def loads(client) -> list[tuple[int, int]]:
    """Per rank (A, then B): its active prefill tokens and requests."""
    rows = (await client.get("/loads", params={"model_name": "default"})).json()
    return [(row["active_prefill_tokens"], row["active_requests"]) for row in rows]


async def active_requests(client) -> int:
    return sum(n for _, n in await loads(client))


async def test_a_selection_booked_through_the_slot_tracker_gets_its_cached_tokens(
    client,
) -> None:
    await two_workers(client)
    r = await post(client, "/select", s1(3, selection_id="q"))
    assert r.json()["worker_id"] == B
    await add(client, "q", B, P8[:3] + [900, 901, 902, 903, 904])
    ok = (200, b'{"status":"ok"}')
    assert await call(client, "/prefill_complete", {**DEFAULT, "request_id": "q",
                                                    "cached_tokens": 8}) == ok  # fmt: skip
    out = (await receipt(client, "q"))["outcome"]
    # predicted 0 cached tokens on B, the engine reported 8 of the 32
    assert (out["cached_tokens"], out["observed_hit_rate"], out["prediction_error_tokens"]) == (
        8,
        0.25,
        -8,
    )
    # booked by the slot tracker, not by this API: no booking or prefill time is known
    assert (out["state"], out["prefill_done_at"]) == ("selected", None)
    assert await call(client, "/free", {**DEFAULT, "request_id": "q", "cached_tokens": 20}) == ok
    out = (await receipt(client, "q"))["outcome"]
    assert (out["cached_tokens"], out["freed_at"]) == (8, None)  # the first report counts
    m = await metrics(client)
    assert m["kv_slot_tracker_router_reported_outcomes_total"] == 1
    assert m["kv_slot_tracker_router_reported_cached_tokens_total"] == 8
    assert m["kv_slot_tracker_router_reported_predicted_cached_tokens_total"] == 0
    assert m["kv_slot_tracker_router_cache_funnel_blocks_total{stage=reported_cached}"] == 2


async def test_a_reservation_freed_through_the_slot_tracker(client, clock) -> None:
    await two_workers(client)
    r = await post(client, "/select_and_reserve", prompt(P8, selection_id="s"))
    assert r.json()["worker_id"] == A
    clock.advance(2.0)
    assert await call(
        client, "/prefill_complete", {**DEFAULT, "request_id": "s", "cached_tokens": 28}
    ) == (200, b'{"status":"ok"}')
    out = (await receipt(client, "s"))["outcome"]
    assert (out["state"], out["cached_tokens"], out["prediction_error_tokens"]) == (
        "booked",
        28,
        4,  # predicted 32
    )
    assert out["prefill_seconds"] == pytest.approx(2.0)
    assert await active_requests(client) == 2  # P8's booking and s
    assert await call(client, "/free", {**DEFAULT, "request_id": "s", "cached_tokens": 0}) == (
        200,
        b'{"status":"ok"}',
    )
    out = (await receipt(client, "s"))["outcome"]
    assert (out["state"], out["cached_tokens"]) == ("freed", 28)
    assert out["freed_at"] is not None
    assert await active_requests(client) == 1
    r = await client.delete(f"{SEL}/reservations/s")
    assert r.status_code == 404  # the request it held is gone


async def test_without_cached_tokens_nothing_is_reported(client) -> None:
    await two_workers(client)
    await post(client, "/select_and_reserve", prompt(P8, selection_id="n"))
    before = await receipt(client, "n")
    for path in ("/prefill_complete", "/free"):
        assert await call(client, path, {**DEFAULT, "request_id": "n"}) == (
            200,
            b'{"status":"ok"}',
        )
    # the reservation's request is freed, the receipt is untouched (as before these fields)
    assert await receipt(client, "n") == before
    assert (await metrics(client))["kv_slot_tracker_router_reported_outcomes_total"] == 0


async def test_bad_cached_tokens_are_refused_and_change_nothing(client) -> None:
    await two_workers(client)
    r = await post(client, "/select_and_reserve", s1(3, selection_id="b"))
    assert r.json()["worker_id"] == B
    assert await loads(client) == [(0, 1), (32, 1)]  # B: 32 prefill tokens pending
    before = await receipt(client, "b")
    for path in ("/prefill_complete", "/free"):
        for bad in (-1, "8", 1.5, True, 2**40 + 1, [8]):
            r = await post_json(client, path, {**DEFAULT, "request_id": "b", "cached_tokens": bad})
            assert r.status_code == 422, (path, bad, r.text)
            error = r.json()["error"]
            assert "cached_tokens" in error, error
    assert await receipt(client, "b") == before
    assert await loads(client) == [(0, 1), (32, 1)]  # neither completed nor freed


async def test_the_receipt_of_another_partition_or_an_unnamed_selection_is_not_touched(
    client,
) -> None:
    await two_workers(client)
    await post(client, "/select_and_reserve", prompt(P8, selection_id="x"))
    await post(client, "/select", s1(3))  # no id: its receipt is auto:1
    r = await post_json(client, "/register", {"model_name": "other", "worker_id": 9,
                                              "block_size": 4, "dp_start": 0, "dp_size": 1})  # fmt: skip
    assert r.status_code == 201
    for rid in ("x", "auto:1"):
        body = {"model_name": "other", "request_id": rid, "worker_id": 9, "dp_rank": 0,
                "sequence_hashes": P8, "new_isl_tokens": 32}  # fmt: skip
        assert (await post_json(client, "/add", body)).status_code == 201
        body = {"model_name": "other", "request_id": rid, "cached_tokens": 4}
        assert (await post_json(client, "/free", body)).status_code == 200
    await add(client, "auto:1", B, P8)
    r = await post_json(client, "/free", {**DEFAULT, "request_id": "auto:1", "cached_tokens": 4})
    assert r.status_code == 200
    assert (await receipt(client, "x"))["outcome"]["cached_tokens"] is None
    assert (await receipt(client, "auto:1"))["outcome"]["cached_tokens"] is None


async def test_batch_operations_carry_cached_tokens(client) -> None:
    await two_workers(client)
    for sid in ("b1", "b2", "b3"):
        await post(client, "/select_and_reserve", prompt(P8, selection_id=sid))
    ops = [
        {"op": "prefill_complete", **DEFAULT, "request_id": "b1", "cached_tokens": 16},
        {"op": "free", **DEFAULT, "request_id": "b2", "cached_tokens": 24},
        {"op": "free", **DEFAULT, "request_id": "b3", "cached_tokens": -5},
        {"op": "free", **DEFAULT, "request_id": "b1"},
    ]
    r = await post_json(client, "/batch", {"operations": ops})
    assert r.status_code == 200
    results = r.json()["results"]
    assert results[0] == results[1] == results[3] == {"status": 200}
    assert results[2]["status"] == 422 and "cached_tokens" in results[2]["error"]
    b1, b2, b3 = [(await receipt(client, sid))["outcome"] for sid in ("b1", "b2", "b3")]
    assert (b1["state"], b1["cached_tokens"]) == ("booked", 16)  # freed without a report
    assert b1["prefill_done_at"] is not None
    assert (b2["state"], b2["cached_tokens"]) == ("freed", 24)
    assert (b3["state"], b3["cached_tokens"]) == ("booked", None)  # refused: not freed
    assert await active_requests(client) == 2  # P8's booking and b3
    # a plain batch (every operation well formed) takes the fast path and does the same
    ops = [{"op": "free", **DEFAULT, "request_id": "b3", "cached_tokens": 12}]
    r = await post_json(client, "/batch", {"operations": ops})
    assert r.json() == {"results": [{"status": 200}]}
    assert (await receipt(client, "b3"))["outcome"]["cached_tokens"] == 12


def test_plain_bodies_with_cached_tokens_take_the_fast_path() -> None:
    assert path_of("/free", b'{"model_name":"m","request_id":"r","cached_tokens":8}') == "plain"
    assert path_of("/prefill_complete", b'{"model_name":"m","request_id":"r"}') == "plain"
    assert (
        path_of(
            "/batch",
            b'{"operations":[{"op":"free","model_name":"m","request_id":"r","cached_tokens":0}]}',
        )  # fmt: skip
        == "plain"
    )
    assert path_of("/free", b'{"model_name":"m","request_id":"r","cached_tokens":-1}') == (
        "validating"
    )


async def test_receipts_off_cached_tokens_are_accepted(make_client) -> None:
    async with make_client(selection_receipts=False) as (_, client):
        await two_workers(client)
        await post(client, "/select_and_reserve", prompt(P8, selection_id="z"))
        r = await post_json(client, "/free", {**DEFAULT, "request_id": "z", "cached_tokens": 3})
        assert (r.status_code, r.content) == (200, b'{"status":"ok"}')
        assert await active_requests(client) == 1


# -- explicit bookings --------------------------------------------------------------------------


async def test_an_explicit_booking_of_the_chosen_rank_books_the_receipt(client, clock) -> None:
    await two_workers(client)
    r = await post(client, "/select", s1(3, selection_id="e"))
    assert r.json()["worker_id"] == B
    assert (await receipt(client, "e"))["outcome"]["state"] == "selected"
    body = {**s1(3), "selection_id": "e", "worker_id": B}
    r = await post(client, "/reservations", body)
    assert r.status_code == 201, r.text
    out = (await receipt(client, "e"))["outcome"]
    assert out["state"] == "booked" and out["booked_at"] is not None
    clock.advance(0.5)
    r = await post(client, "/reservations/e/prefill_complete", {"cached_tokens": 4})
    assert r.status_code == 200
    out = (await receipt(client, "e"))["outcome"]
    assert out["prefill_seconds"] == pytest.approx(0.5)
    assert (out["cached_tokens"], out["prediction_error_tokens"]) == (4, -4)
    assert (await client.delete(f"{SEL}/reservations/e")).status_code == 200
    out = (await receipt(client, "e"))["outcome"]
    assert out["state"] == "freed" and out["freed_at"] is not None
    m = await metrics(client)
    assert m["kv_slot_tracker_router_reported_outcomes_total"] == 1
    assert m["kv_slot_tracker_router_reported_cached_tokens_total"] == 4
    assert m["kv_slot_tracker_router_decisions_total"] == 1  # a booking is no decision


async def test_an_explicit_booking_elsewhere_is_not_the_decisions_outcome(client) -> None:
    await two_workers(client)
    await post(client, "/select", s1(3, selection_id="o"))  # chose B
    r = await post(client, "/reservations", {**s1(3), "selection_id": "o", "worker_id": A})
    assert r.status_code == 201
    r = await post(client, "/reservations/o/prefill_complete", {"cached_tokens": 12})
    assert r.status_code == 200
    out = (await receipt(client, "o"))["outcome"]
    assert (out["state"], out["cached_tokens"]) == ("selected", None)
    assert (await metrics(client))["kv_slot_tracker_router_reported_outcomes_total"] == 0
