"""``replay_endpoints``: a worker of several dp ranks whose every rank has its own replay socket
(as vLLM binds rank r's at the replay port + r). Two publishers speaking the engines' framing
(``fake_engine``), real ZMQ sockets, a real app with KV events on; the index read through
``/selection/overlap_scores``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from .fake_engine import TOKENS, chain
from .test_kv_listener import BS, PREFIX, app_with, eventually, metrics, warning


def overlap_body(scores: dict[int, int]) -> dict[str, Any]:
    """``/overlap_scores`` of ``TOKENS`` when rank r of worker 7 holds ``scores[r]`` blocks."""
    return {
        "block_size": BS,
        "num_blocks": len(TOKENS) // BS,
        "workers": [
            {
                "worker_id": 7,
                "dp_rank": rank,
                "device_blocks": n,
                "host_pinned_blocks": n,
                "disk_blocks": n,
                "host_pinned_extension_blocks": 0,
                "disk_extension_blocks": 0,
                "shared_beyond_device_blocks": None,
            }
            for rank, n in sorted(scores.items())
        ],
        "shared_cache": {"enabled": False, "total_hit_blocks": 0, "ranges": [], "error": None},
    }


@pytest.mark.parametrize("start", [0, 2], ids=["ranks-0-1", "ranks-2-3"])
async def test_a_late_listener_replays_each_rank_from_its_own_socket(
    engines: Any, start: int
) -> None:
    """Both ranks published before anyone listened (rank ``start`` four batches, the next rank
    two); the first live batch of each shows the gap, and each rank's listener asks its own
    replay socket, which answers only for its rank."""
    ranks = [start, start + 1]
    first, second = engines(dp_rank=ranks[0]), engines(dp_rank=ranks[1])
    batches = {ranks[0]: chain(5), ranks[1]: chain(3)}
    for events in batches[ranks[0]][:4]:
        first.publish(events, send=False)
    for events in batches[ranks[1]][:2]:
        second.publish(events, send=False)
    async with await app_with() as (_, client):
        body = {
            "worker_id": 7,
            "endpoint": "http://w7",
            "block_size": BS,
            "data_parallel_start_rank": start,
            "data_parallel_size": 2,
            "kv_events_endpoints": {str(ranks[0]): first.endpoint, str(ranks[1]): second.endpoint},
            "replay_endpoints": [first.replay_endpoint, second.replay_endpoint],
        }
        r = await client.post(PREFIX + "/workers", json=body)
        assert r.status_code == 201, r.text
        assert r.json()["lifecycle"] == "schedulable", r.json()
        assert r.json()["replay_endpoints"] == body["replay_endpoints"]
        await asyncio.to_thread(first.wait_subscribed)
        await asyncio.to_thread(second.wait_subscribed)
        first.publish(batches[ranks[0]][4])
        second.publish(batches[ranks[1]][2])

        async def scores() -> Any:
            r = await client.post(PREFIX + "/overlap_scores", json={"token_ids": TOKENS})
            assert r.status_code == 200, r.text
            return r.json()

        await eventually(scores, overlap_body({ranks[0]: 5, ranks[1]: 3}))
        # each socket was asked once, from sequence 0, by its own rank only
        assert first.replay_requests == [0]
        assert second.replay_requests == [0]
        m = await metrics(client)
        assert m["kv_slot_tracker_kv_events_replays_total"] == 2
        assert m["kv_slot_tracker_kv_events_replayed_batches_total"] == 5 + 3
        assert m[warning("replay_incomplete")] == 0
        assert m[warning("dp_rank_out_of_range")] == 0
        assert m["kv_slot_tracker_kv_events_gaps_lost_total"] == 0


async def test_one_socket_for_both_ranks_would_be_refused(engines: Any) -> None:
    """Without the list, the reference's rule keeps such a worker off the schedule: nothing is
    subscribed and nothing replayed."""
    first, second = engines(dp_rank=0), engines(dp_rank=1)
    first.publish(chain(1)[0], send=False)
    async with await app_with() as (_, client):
        body = {
            "worker_id": 7,
            "endpoint": "http://w7",
            "block_size": BS,
            "data_parallel_size": 2,
            "kv_events_endpoints": {"0": first.endpoint, "1": second.endpoint},
            "replay_endpoint": first.replay_endpoint,
        }
        r = await client.post(PREFIX + "/workers", json=body)
        assert r.json()["lifecycle"] == "incomplete"
        # the same worker with the list: listened to, and rank 0 replayed from its socket
        del body["replay_endpoint"]
        body["replay_endpoints"] = [first.replay_endpoint, second.replay_endpoint]
        r = await client.post(PREFIX + "/workers", json=body)
        assert r.json()["lifecycle"] == "schedulable", r.json()
        await asyncio.to_thread(first.wait_subscribed)
        first.publish(chain(2)[1])

        async def replayed() -> Any:
            return first.replay_requests, second.replay_requests

        await eventually(replayed, ([0], []))
