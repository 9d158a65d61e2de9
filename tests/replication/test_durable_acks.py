"""``replication_ack = "redis"``: a mutating call is answered only once its record is in the
stream; calls waiting at one moment share one append (group commit); while Redis cannot be
reached, calls answer 503 within a bounded time and, once the outage is known, change nothing.

Whole apps in this process on a real Redis (``tests/replication/apps.py``)."""

from __future__ import annotations

import asyncio

import pytest
import redis

from kv_slot_tracker.replication.redis.stream import NamespaceKeys
from kv_slot_tracker.settings import Settings
from tests.replication.apps import register, running_apps, until
from tests.replication.helpers import proxied
from tests.support.records import entry_view

pytestmark = pytest.mark.redis


def settings(url: str, namespace: str, **overrides) -> Settings:
    return Settings(redis_url=url, namespace=namespace, snapshot_interval_seconds=3600,
                    **overrides)  # fmt: skip


def stream_requests(redis_url: str, namespace: str) -> list[str]:
    """Request ids of the add records in the stream, in order."""
    client = redis.Redis.from_url(redis_url)
    try:
        entries = client.xrange(NamespaceKeys.of(namespace).events)
    finally:
        client.close()
    out = []
    for _, fields in entries:
        record = entry_view(fields[b"d"])
        event = record.get("event")
        if event is not None and isinstance(event["data"], dict):
            out.append(event["request_id"])
    return out


async def test_an_acknowledged_call_is_in_the_stream(redis_url: str, namespace: str) -> None:
    # the outbox waits 200 ms to fill a batch: with local acks the answer comes long before
    async with running_apps(
        settings(redis_url, namespace, replication_ack="redis", replication_batch_ms=200),
    ) as (a,):
        await register(a, [])
        assert await a.add("x") == 201
        assert stream_requests(redis_url, namespace) == ["x"]
        # calls waiting at one moment share one append round trip
        statuses = await asyncio.gather(*(a.add(f"g{i}") for i in range(20)))
        assert statuses == [201] * 20
        assert stream_requests(redis_url, namespace) == ["x"] + [f"g{i}" for i in range(20)]
        calls = a.metric("replication_group_commit_calls_count")
        assert calls < 10  # 22 acknowledged calls (register, x, g0..g19) in a few appends
        assert a.metric("replication_group_commit_calls_sum") == 22
        # a call that changes nothing (an error, or nothing to replicate) is answered at once
        assert await a.add("x") == 409
        assert (await a.call("output_block", "x")).status_code == 200  # local by design
        assert a.metric("replication_group_commit_calls_sum") == 22


async def test_while_redis_is_unreachable_calls_answer_503_and_change_nothing(
    redis_url: str, namespace: str
) -> None:
    async with (
        proxied(redis_url) as proxy,
        running_apps(
            settings(
                proxy.url(), namespace, replication_ack="redis", replication_ack_timeout_ms=300
            ),  # fmt: skip
            settings(redis_url, namespace, replication_ack="redis"),
        ) as (a, b),
    ):
        await register(a, [b])
        assert await a.add("before") == 201
        proxy.cut()
        # not known yet to be unreachable: applied here, then not acknowledged in time
        answer = await a.add("x")
        assert answer == 503
        body = (await a.call("free", "before")).json()
        assert body["error"].startswith("not accepted: Redis"), body
        loads = await a.loads()
        depth = a.replication.status().outbox_depth
        free = {"model_name": "m", "request_id": "before"}
        for path, body in (
            ("/add", {"model_name": "m", "request_id": "y", "worker_id": 1, "dp_rank": 0,
                      "sequence_hashes": [1]}),
            ("/free", free),
            ("/prefill_complete", free),
            ("/register", {"model_name": "m", "worker_id": 2, "block_size": 16}),
            ("/batch", {"operations": [{"op": "free", **free}]}),
        ):  # fmt: skip
            r = await a.post(path, body)
            assert r.status_code == 503 and r.json()["error"].startswith("not accepted")
        assert await a.loads() == loads  # nothing changed
        assert a.replication.status().outbox_depth == depth
        assert a.metric("consistency_ack_refused_total") == 6
        assert a.metric("consistency_ack_timeouts_total") == 1
        # reads go on from local state
        assert (await a.client.get("/loads")).status_code == 200
        proxy.restore()
        # the call that timed out was applied here: it reaches b when Redis answers again
        await until(lambda: a.outbox_empty(), what="a's outbox to drain")

        async def b_has_x() -> bool:
            rows = await b.loads()
            return sum(r["active_requests"] for r in rows) == 2

        await until(b_has_x, what="x on b")
        assert await a.add("z") == 201


async def test_ids_the_barrier_proves_unknown_are_answered_as_one_instance(
    redis_url: str, namespace: str
) -> None:
    """With durable acknowledgements every acknowledged add is in the stream, so after the read
    barrier an id still unknown is certainly unknown: the answer is one instance's (a free of an
    unknown model 404, of an unknown id 200), and a free still leaves its tombstone."""
    async with running_apps(
        settings(redis_url, namespace, replication_ack="redis"),
        settings(redis_url, namespace, replication_ack="redis"),
    ) as (a, b):
        await register(a, [b])
        r = await b.post("/free", {"model_name": "other", "request_id": "x"})
        assert (r.status_code, r.json()) == (
            404, {"error": "no slot tracker for model=other routing_group=default"}
        )  # fmt: skip
        assert (await b.call("free", "nowhere")).status_code == 200
        r = await b.call("prefill_complete", "nowhere")
        assert (r.status_code, r.json()) == (404, {"error": "Request nowhere not found"})
        assert b.metric("consistency_tombstones_created_total") == 2
        assert b.metric("consistency_marks_created_total") == 0
