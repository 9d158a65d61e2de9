"""Routing receipts over HTTP (``/selection/receipts``, ``/selection/explain``, the outcome body of
a reservation's ``prefill_complete`` and ``DELETE``) and the decision metrics, with exact numbers.

Workers A=1, B=2, block size 4, KV events off (the approximate cache holds what was booked). The
base state of SELECTION.md §4: A holds the 8 blocks P8 (an explicit booking, prefill done), so
A: P=0, D=8, one request; B is empty. Costs follow §4: a query of the first k blocks of P8 and
8-k new ones (isl 32) costs 24-2k on A and 16 on B.
"""

from __future__ import annotations

import re
from typing import Any

import orjson
import pytest

from tests.api.selection.helpers import P8, SEL, A, B, add_worker, holds_p8, post, prompt

NEW = [900 + i for i in range(8)]


def s1(k: int, **fields: Any) -> dict[str, Any]:
    """§4 S1's query: the first ``k`` blocks of P8, then new blocks."""
    return prompt(P8[:k] + NEW[: 8 - k], **fields)


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    return {"selection_seed": 7, "session_affinity_ttl_seconds": 100.0}


async def two_workers(client) -> None:
    await add_worker(client, A)
    await add_worker(client, B)
    await holds_p8(client)


def rank(w: int, r: int = 0) -> dict[str, int]:
    return {"worker_id": w, "dp_rank": r}


async def receipt(client, rid: str) -> dict[str, Any]:
    r = await client.get(f"{SEL}/receipts/{rid}")
    assert r.status_code == 200, r.text
    return r.json()


async def metrics(client) -> dict[str, float]:
    """The default partition's decision series: ``name`` or ``name{label=value}`` (labels
    other than the partition's, sorted) -> value."""
    out = {}
    for line in (await client.get("/metrics")).text.splitlines():
        m = re.fullmatch(r"(kv_slot_tracker_router_\w+)\{(.*)\} (\S+)", line)
        if m is None:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m[2]))
        if (labels.pop("model_name"), labels.pop("routing_group")) != ("default", "default"):
            continue
        rest = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        out[m[1] + (f"{{{rest}}}" if rest else "")] = float(m[3])
    return out


async def test_a_receipt_shows_every_candidates_cost_terms(client) -> None:
    await two_workers(client)
    r = await post(client, "/select", s1(3, selection_id="q1"))
    assert r.status_code == 200 and r.json()["worker_id"] == B
    body = await receipt(client, "q1")
    assert body["selection_id"] == "q1" and body["action"] == "select"
    assert body["instance"]
    assert (body["prompt_blocks"], body["isl_tokens"], body["block_size"]) == (8, 32, 4)
    assert body["candidates"] == [
        {
            "worker_id": A,
            "dp_rank": 0,
            "device_blocks": 3,
            "host_pinned_extension_blocks": 0,
            "disk_extension_blocks": 0,
            "overlap_credit_blocks": 3.0,
            "credit_decay": 1.0,
            "active_prefill_tokens": 0,
            "potential_decode_blocks": 13,  # D 8 + 5 new blocks
            "active_requests": 1,
            "cost": 18.0,  # (32/4 - 3) + 13
        },
        {
            "worker_id": B,
            "dp_rank": 0,
            "device_blocks": 0,
            "host_pinned_extension_blocks": 0,
            "disk_extension_blocks": 0,
            "overlap_credit_blocks": 0.0,
            "credit_decay": 1.0,
            "active_prefill_tokens": 0,
            "potential_decode_blocks": 8,
            "active_requests": 0,
            "cost": 16.0,
        },
    ]
    assert body["chosen"] == rank(B)
    assert (body["chosen_overlap_blocks"], body["max_overlap_blocks"]) == (0, 3)
    assert body["max_overlap_ranks"] == [rank(A)]
    assert (body["optimal"], body["non_optimal_reason"], body["decided_by"]) == (
        False,
        "load",
        "cost",
    )
    assert body["overlap_blocks_lost"] == 3
    assert body["tie_set"] == [rank(B)]
    assert body["predicted"] == {
        "hit_rate": 0.0,
        "cached_tokens": 0,
        "effective_prefill_tokens": 32,
    }
    assert body["outcome"]["state"] == "selected"


async def test_the_observed_outcome_is_joined_with_the_prediction(client, clock) -> None:
    await two_workers(client)
    r = await post(client, "/select_and_reserve", prompt(P8, selection_id="s2"))
    assert r.json()["worker_id"] == A
    body = await receipt(client, "s2")
    assert body["optimal"] is True and body["non_optimal_reason"] is None
    assert body["candidates"][0]["cost"] == 8.0 and body["candidates"][1]["cost"] == 16.0
    assert body["predicted"]["cached_tokens"] == 32
    assert body["outcome"]["state"] == "booked"
    clock.advance(1.5)
    r = await post(client, "/reservations/s2/prefill_complete", {"cached_tokens": 24})
    assert (r.status_code, r.json()) == (200, {"status": "ok"})
    out = (await receipt(client, "s2"))["outcome"]
    assert out["cached_tokens"] == 24
    assert out["observed_hit_rate"] == 0.75
    assert out["prediction_error_tokens"] == 8
    assert out["prefill_seconds"] == pytest.approx(1.5)
    r = await client.delete(f"{SEL}/reservations/s2")
    assert r.status_code == 200
    out = (await receipt(client, "s2"))["outcome"]
    assert out["state"] == "freed" and out["cached_tokens"] == 24  # the first report counts
    m = await metrics(client)
    assert m["kv_slot_tracker_router_decisions_total"] == 1
    assert m["kv_slot_tracker_router_decision_kv_optimal_total"] == 1
    assert m["kv_slot_tracker_router_reported_outcomes_total"] == 1
    assert m["kv_slot_tracker_router_cache_funnel_blocks_total{stage=prompt}"] == 8
    assert m["kv_slot_tracker_router_cache_funnel_blocks_total{stage=chosen}"] == 8
    assert m["kv_slot_tracker_router_cache_funnel_blocks_total{stage=reported_cached}"] == 6
    # predicted 32, reported 24: an error of 8 (the histogram has negative buckets: no sum)
    assert m["kv_slot_tracker_router_kv_hit_prediction_error_tokens_bucket{le=0.0}"] == 0
    assert m["kv_slot_tracker_router_kv_hit_prediction_error_tokens_bucket{le=16.0}"] == 1
    assert m["kv_slot_tracker_router_reported_predicted_cached_tokens_total"] == 32
    assert m["kv_slot_tracker_router_reported_cached_tokens_total"] == 24
    assert m["kv_slot_tracker_router_observed_kv_hit_rate_sum"] == 0.75
    assert m["kv_slot_tracker_router_kv_hit_rate_sum"] == 1.0
    summary = (await client.get(f"{SEL}/receipts?limit=0")).json()
    assert summary["receipts"] == []
    assert summary["partitions"] == [
        {
            "model_name": "default",
            "routing_group": "default",
            "decisions": 1,
            "kv_optimal": 1,
            "non_optimal": dict.fromkeys(
                ("load", "tie", "temperature", "pin", "session", "allowed"), 0
            ),
            "overlap_blocks_lost": 0,
            "funnel_blocks": {"prompt": 8, "indexed_any": 8, "chosen": 8, "reported_cached": 6},
            "predicted_hit_rate": 1.0,
            "reported": 1,
            "reported_predicted_hit_rate": 1.0,
            "observed_hit_rate": 0.75,
            "mean_prediction_error_tokens": 8.0,
            "kv_checked": 0,
            "kv_predicted_blocks": 0,
            "kv_still_held_blocks": 0,
        }
    ]


async def test_cached_tokens_on_delete_and_bad_bodies(client) -> None:
    await two_workers(client)
    await post(client, "/select_and_reserve", prompt(P8, selection_id="s3"))
    for bad, status in ((b'{"cached_tokens": -1}', 422), (b'{"cached_tokens": "x"}', 422),
                        (b"{", 400)):  # fmt: skip
        r = await client.request(
            "DELETE", f"{SEL}/reservations/s3", content=bad,
            headers={"content-type": "application/json"},
        )  # fmt: skip
        assert r.status_code == status, r.text
        assert "error" in r.json()
    assert (await receipt(client, "s3"))["outcome"]["state"] == "booked"  # nothing changed
    r = await client.request(
        "DELETE", f"{SEL}/reservations/s3", content=b'{"cached_tokens": 40}',
        headers={"content-type": "application/json"},
    )  # fmt: skip
    assert r.status_code == 200
    out = (await receipt(client, "s3"))["outcome"]
    # reported more than the prompt: capped at the prompt's 32 tokens
    assert (out["state"], out["cached_tokens"], out["prediction_error_tokens"]) == ("freed", 32, 0)


async def test_ties_pins_allowed_lists_and_sessions_say_what_decided(client) -> None:
    await two_workers(client)
    seen = set()
    ties_lost = 0
    for i in range(12):  # S1 k=4: both cost 16
        r = await post(client, "/select", s1(4, selection_id=f"t{i}"))
        body = await receipt(client, f"t{i}")
        assert body["decided_by"] == "tie"
        assert body["tie_set"] == [rank(A), rank(B)]
        assert body["chosen"] == rank(r.json()["worker_id"])
        assert body["non_optimal_reason"] == (None if r.json()["worker_id"] == A else "tie")
        seen.add(r.json()["worker_id"])
        ties_lost += r.json()["worker_id"] == B
    assert seen == {A, B}

    await post(client, "/select", prompt(P8, selection_id="pin", pinned_worker=rank(B)))
    body = await receipt(client, "pin")
    assert (body["decided_by"], body["non_optimal_reason"], body["overlap_blocks_lost"]) == (
        "pin",
        "pin",
        8,
    )
    assert [c["cost"] for c in body["candidates"]] == [None, 16.0]

    await post(client, "/select", prompt(P8, selection_id="only", allowed_worker_ids=[B]))
    body = await receipt(client, "only")
    assert (body["decided_by"], body["non_optimal_reason"]) == ("only_candidate", "allowed")
    assert body["allowed_worker_ids"] == [B]

    # a session bound to B (pinned booking) keeps the next selection on B although A is cheaper
    r = await post(
        client,
        "/select_and_reserve",
        prompt(NEW, selection_id="bind", session_id="u", pinned_worker=rank(B)),
    )
    assert r.json()["worker_id"] == B
    await post(client, "/select", prompt(P8, selection_id="sess", session_id="u"))
    body = await receipt(client, "sess")
    assert (body["decided_by"], body["non_optimal_reason"]) == ("session", "session")
    assert (body["session_id"], body["session_worker_id"]) == ("u", B)

    m = await metrics(client)
    assert m["kv_slot_tracker_router_decisions_total"] == 12 + 4
    assert m["kv_slot_tracker_router_non_max_overlap_selections_total{reason=tie}"] == ties_lost
    assert m["kv_slot_tracker_router_non_max_overlap_selections_total{reason=pin}"] == 1
    assert m["kv_slot_tracker_router_non_max_overlap_selections_total{reason=allowed}"] == 1
    assert m["kv_slot_tracker_router_non_max_overlap_selections_total{reason=session}"] == 1
    # the tied ones gave up 4 blocks each, pin, allowed and session 8 each; "bind" lost none
    assert m["kv_slot_tracker_router_overlap_blocks_lost_total"] == 4 * ties_lost + 24


async def test_temperature_draws_are_named(make_client) -> None:
    async with make_client(selection_seed=3, router_temperature=1.0) as (_, client):
        await two_workers(client)
        await post(client, "/select", prompt(P8, selection_id="t"))
        body = (await client.get(f"{SEL}/receipts/t")).json()
        assert body["decided_by"] == "temperature" and body["temperature"] == 1.0
        assert [c["cost"] for c in body["candidates"]] == [8.0, 16.0]


async def test_listing_filters_limits_and_ndjson(client, clock) -> None:
    await two_workers(client)
    await post(client, "/select", s1(3))  # no id: named auto:1
    t0 = (await client.get(f"{SEL}/receipts")).json()["receipts"][0]["time"]
    await post(client, "/select", prompt(P8, selection_id="b"))
    await post(client, "/select", prompt(P8, selection_id="c", pinned_worker=rank(B)))
    r = await client.get(f"{SEL}/receipts")
    listing = r.json()
    assert listing["instance"] and [x["receipt_id"] for x in listing["receipts"]] == [
        "c",
        "b",
        "auto:1",
    ]
    ids = lambda q: [x["receipt_id"] for x in q.json()["receipts"]]  # noqa: E731
    assert ids(await client.get(f"{SEL}/receipts?non_optimal=true")) == ["c", "auto:1"]
    assert ids(await client.get(f"{SEL}/receipts?worker_id={A}")) == ["b"]
    assert ids(await client.get(f"{SEL}/receipts?limit=1")) == ["c"]
    assert ids(await client.get(f"{SEL}/receipts?model_name=other")) == []
    assert ids(await client.get(f"{SEL}/receipts?until={t0}")) == []
    assert len(ids(await client.get(f"{SEL}/receipts?since={t0}"))) == 3
    r = await client.get(f"{SEL}/receipts?format=ndjson")
    assert r.headers["content-type"].startswith("application/x-ndjson")
    lines = [orjson.loads(line) for line in r.content.splitlines()]
    assert [x["receipt_id"] for x in lines] == ["c", "b", "auto:1"]
    r = await client.get(f"{SEL}/receipts", headers={"accept": "application/x-ndjson"})
    assert len(r.content.splitlines()) == 3
    for bad in ("limit=-1", "limit=1001", "limit=x", "format=xml", "since=x"):
        r = await client.get(f"{SEL}/receipts?{bad}")
        assert r.status_code == 400 and "error" in r.json(), bad
    r = await client.get(f"{SEL}/receipts/nope")
    assert r.status_code == 404 and "nope" in r.json()["error"]
    # an id percent-encoded in the path (as the Python client sends every id) is found
    r = await client.get(f"{SEL}/receipts/auto%3A1")
    assert (r.status_code, r.json()["receipt_id"]) == (200, "auto:1")


async def test_explain_changes_nothing(client) -> None:
    await two_workers(client)
    before = (await client.get(f"{SEL}/loads")).json()
    r = await post(client, "/explain", s1(3, selection_id="x"))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["action"] == "explain" and body["chosen"] == rank(B)
    assert [c["cost"] for c in body["candidates"]] == [18.0, 16.0]
    assert (await client.get(f"{SEL}/loads")).json() == before
    assert (await client.get(f"{SEL}/receipts/x")).status_code == 404
    assert (await client.get(f"{SEL}/receipts")).json()["receipts"] == []
    # no pending selection was cached: replaying the id finds nothing
    r = await post(client, "/reservations", {"selection_id": "x"})
    assert r.status_code == 404
    assert (await metrics(client)).get("kv_slot_tracker_router_decisions_total") is None
    for bad, status in ((b"{", 400), (b"[]", 422)):
        r = await client.post(f"{SEL}/explain", content=bad,
                              headers={"content-type": "application/json"})  # fmt: skip
        assert r.status_code == status
    r = await post(client, "/explain", {"model_name": "nobody", "token_ids": [1]})
    assert r.status_code == 503


async def test_receipts_off(make_client) -> None:
    async with make_client(selection_receipts=False) as (_, client):
        await two_workers(client)
        r = await post(client, "/select_and_reserve", prompt(P8, selection_id="z"))
        assert r.status_code == 200
        assert (await client.get(f"{SEL}/receipts/z")).status_code == 404
        assert (await client.get(f"{SEL}/receipts")).status_code == 404
        r = await post(client, "/reservations/z/prefill_complete", {"cached_tokens": 3})
        assert r.status_code == 200
        assert (await post(client, "/explain", prompt(P8))).status_code == 200
        assert "kv_slot_tracker_router_decisions_total" not in (await client.get("/metrics")).text


async def test_lifecycle_calls_without_a_body_are_unchanged(client) -> None:
    await two_workers(client)
    await post(client, "/select_and_reserve", prompt(P8, selection_id="n"))
    r = await client.post(f"{SEL}/reservations/n/prefill_complete")
    assert (r.status_code, r.json()) == (200, {"status": "ok"})
    r = await client.delete(f"{SEL}/reservations/n")
    assert (r.status_code, r.json()) == (200, {"status": "ok"})
    assert (await receipt(client, "n"))["outcome"]["cached_tokens"] is None
    r = await client.delete(f"{SEL}/reservations/n")
    assert r.status_code == 404
