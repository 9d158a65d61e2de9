"""KV events with several instances: each subscribes to the engines itself.

The worker catalog travels through Redis; the events do not. A real publisher process (vLLM's
format, with a replay socket) feeds every instance; one instance starts after the engine has
published, and recovers the index from the engine's replay buffer when the next batch reveals the
gap. All answer the same overlap scores after the publisher's last batch.
"""

from __future__ import annotations

import asyncio

import pytest

from bench.kv_publisher import PublisherProcess, removed, stored
from kv_slot_tracker.settings import Settings
from tests.replication.apps import App, running_apps, until

pytestmark = pytest.mark.redis

SEL = "/selection"
BS = 4
TOKENS = list(range(100, 124))


def settings(redis_url: str, namespace: str) -> Settings:
    return Settings(redis_url=redis_url, namespace=namespace, snapshot_interval_seconds=3600,
                    router_use_kv_events=True)  # fmt: skip


async def device_blocks(app: App) -> list[tuple[int, int, int]]:
    r = await app.post(SEL + "/overlap_scores", {"token_ids": TOKENS})
    if r.status_code != 200:
        return []
    return [(w["worker_id"], w["dp_rank"], w["device_blocks"]) for w in r.json()["workers"]]


async def test_every_instance_follows_the_engine_and_a_late_one_replays(
    redis_url: str, namespace: str
) -> None:
    with PublisherProcess(ranks=1) as pub:
        async with running_apps(settings(redis_url, namespace), settings(redis_url, namespace)) as (
            a, b,
        ):  # fmt: skip
            r = await a.post(SEL + "/workers", {
                "worker_id": 1, "endpoint": "http://w1", "block_size": BS,
                "kv_events_endpoint": pub.endpoints[0],
                "replay_endpoint": pub.replay_endpoints[0],
            })  # fmt: skip
            assert r.json()["lifecycle"] == "schedulable"
            await asyncio.to_thread(pub.wait_subscribers, 0, 2)  # b learnt it through Redis
            pub.publish(0, [stored([1, 2, 3], TOKENS[:12], BS)])
            pub.publish(0, [stored([4], TOKENS[12:16], BS, parent=3)])

            async def both(want: list[tuple[int, int, int]]) -> bool:
                return all([await device_blocks(x) == want for x in (a, b)])

            await until(lambda: both([(1, 0, 4)]), what="a and b indexed the stores")
            async with running_apps(settings(redis_url, namespace)) as (c,):
                await asyncio.to_thread(pub.wait_subscribers, 0, 3)
                assert await device_blocks(c) == [(1, 0, 0)]  # published before it listened
                pub.publish(0, [removed([4])])  # sequence 2: c sees 0 and 1 missing, replays

                async def all_three() -> bool:
                    return all([await device_blocks(x) == [(1, 0, 3)] for x in (a, b, c)])

                await until(all_three, what="all three agree after the replay")
                # the replay answers every batch the engine kept, sequence 2 included, so the
                # index may agree before the end of the replay, when it is counted
                await until(lambda: c.metric("kv_events_replays_total") == 1,
                            what="c counted its replay")  # fmt: skip
                assert a.metric("kv_events_replays_total") == 0
