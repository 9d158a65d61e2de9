"""KV events end to end: a real publisher process speaking vLLM's format feeds a real app.

The publisher (``bench/kv_publisher.py``) binds a PUB socket and a replay ROUTER per rank on
127.0.0.1; the app (KV events on) subscribes to them when the worker is registered over HTTP, and
``/selection/overlap_scores`` shows what the index holds. Nothing of ZMQ is mocked.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
import zmq
from fastapi import FastAPI

from bench.kv_publisher import CLEARED, PublisherProcess, removed, stored
from kv_slot_tracker.ingest.records import encode_batch, seq_frame
from tests.api.conftest import running_app
from tests.fakes import FakeClock
from tests.ports import free_port

BS = 4
TOKENS = list(range(100, 124))  # six blocks
PREFIX = "/selection"


@pytest.fixture
def publisher() -> Any:
    with PublisherProcess(ranks=2) as pub:
        yield pub


@pytest.fixture
async def kv_app() -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    async with running_app(FakeClock(), router_use_kv_events=True) as pair:
        yield pair


async def eventually(probe: Callable[[], Any], want: Any, timeout: float = 10.0) -> None:
    """Poll ``probe`` (async) until it returns ``want``."""
    deadline = time.monotonic() + timeout
    got = None
    while time.monotonic() < deadline:
        got = await probe()
        if got == want:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"still {got!r}, wanted {want!r}")


def overlap(client: httpx.AsyncClient, model: str = "default") -> Callable[[], Any]:
    async def probe() -> list[tuple[int, ...]]:
        r = await client.post(
            PREFIX + "/overlap_scores", json={"model_name": model, "token_ids": TOKENS}
        )
        assert r.status_code == 200, r.text
        return sorted(
            (
                w["worker_id"], w["dp_rank"], w["device_blocks"],
                w["host_pinned_extension_blocks"], w["disk_extension_blocks"],
            )
            for w in r.json()["workers"]
        )  # fmt: skip

    return probe


async def register(
    client: httpx.AsyncClient, pub: PublisherProcess, worker_id: int, **extra: Any
) -> dict:
    body = {
        "worker_id": worker_id,
        "endpoint": f"http://w{worker_id}",
        "block_size": BS,
        "data_parallel_size": 2,
        "kv_events_endpoints": {"0": pub.endpoints[0], "1": pub.endpoints[1]},
        **extra,
    }
    r = await client.post(PREFIX + "/workers", json=body)
    assert r.status_code == 201, r.text
    assert r.json()["lifecycle"] == "schedulable"
    for endpoint in body["kv_events_endpoints"].values():
        await asyncio.to_thread(pub.wait_subscribers, pub.endpoints.index(endpoint), 1)
    return r.json()


async def metric(client: httpx.AsyncClient, name: str) -> float:
    text = (await client.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "_total "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


async def test_worker_without_publishers_is_incomplete(kv_app: Any) -> None:
    _, client = kv_app
    r = await client.post(
        PREFIX + "/workers",
        json={"worker_id": 9, "endpoint": "http://w", "block_size": 4, "data_parallel_size": 2,
              "kv_events_endpoint": "tcp://127.0.0.1:1"},
    )  # fmt: skip
    assert r.status_code == 201
    assert r.json()["lifecycle"] == "incomplete"
    assert r.json()["not_schedulable_reasons"] == [
        "kv_events endpoint is required for dp_rank 0",
        "kv_events endpoint is required for dp_rank 1",
    ]
    r = await client.post(PREFIX + "/workers", json={"worker_id": 8, "block_size": 4})
    assert r.json()["not_schedulable_reasons"] == [
        "endpoint is required",
        "kv_events endpoint is required for dp_rank 0",
    ]


async def test_stores_removals_clears_follow_the_engine(
    kv_app: Any, publisher: PublisherProcess
) -> None:
    _, client = kv_app
    await register(client, publisher, 1)
    probe = overlap(client)
    assert await probe() == [(1, 0, 0, 0, 0), (1, 1, 0, 0, 0)]
    publisher.publish(0, [stored([11, 12, 13], TOKENS[:12], BS)])
    await eventually(probe, [(1, 0, 3, 0, 0), (1, 1, 0, 0, 0)])
    # rank 1's socket, and a batch naming its rank explicitly
    publisher.publish(1, [stored([11, 12], TOKENS[:8], BS)], dp_rank=1)
    await eventually(probe, [(1, 0, 3, 0, 0), (1, 1, 2, 0, 0)])
    # a middle block removed cuts the prefix there
    publisher.publish(0, [removed([12])])
    await eventually(probe, [(1, 0, 1, 0, 0), (1, 1, 2, 0, 0)])
    # host and disk tiers extend the device prefix
    publisher.publish(0, [stored([12, 13], TOKENS[4:12], BS, parent=11, medium="CPU")])
    publisher.publish(0, [stored([14], TOKENS[12:16], BS, parent=13, medium="DISK")])
    await eventually(probe, [(1, 0, 1, 2, 1), (1, 1, 2, 0, 0)])
    # clearing one rank leaves the other
    publisher.publish(0, [CLEARED])
    await eventually(probe, [(1, 0, 0, 0, 0), (1, 1, 2, 0, 0)])
    assert await metric(client, "kv_slot_tracker_kv_events_batches") == 6
    assert await metric(client, "kv_slot_tracker_kv_events_gaps") == 0
    # every frame counted (an empty topic, 8 sequence bytes, the payload; a float64 ts packs
    # to 9 bytes whatever its value): what the heap trim after a burst is triggered by
    sent = [
        ([stored([11, 12, 13], TOKENS[:12], BS)], 0),
        ([stored([11, 12], TOKENS[:8], BS)], 1),
        ([removed([12])], 0),
        ([stored([12, 13], TOKENS[4:12], BS, parent=11, medium="CPU")], 0),
        ([stored([14], TOKENS[12:16], BS, parent=13, medium="DISK")], 0),
        ([CLEARED], 0),
    ]
    expected = sum(8 + len(encode_batch(0.0, events, dp)) for events, dp in sent)
    assert await metric(client, "kv_slot_tracker_kv_events_bytes") == expected


async def test_a_gap_without_replay_carries_on(kv_app: Any, publisher: PublisherProcess) -> None:
    """The default gap policy (``continue``, as the reference): the rank keeps its blocks."""
    _, client = kv_app
    await register(client, publisher, 1)
    probe = overlap(client)
    publisher.publish(0, [stored([1, 2], TOKENS[:8], BS)])
    await eventually(probe, [(1, 0, 2, 0, 0), (1, 1, 0, 0, 0)])
    publisher.publish(0, [stored([3], TOKENS[8:12], BS, parent=2)], drop=True)  # lost
    publisher.publish(0, [stored([4], TOKENS[12:16], BS, parent=3)])
    await eventually(lambda: metric(client, "kv_slot_tracker_kv_events_gaps_lost"), 1.0)
    # block 4's parent never came: refused; blocks 1 and 2 stay
    await eventually(lambda: metric(client, "kv_slot_tracker_kv_events_stores_refused"), 1.0)
    assert await probe() == [(1, 0, 2, 0, 0), (1, 1, 0, 0, 0)]
    # the stream goes on from there
    publisher.publish(0, [stored([3], TOKENS[8:12], BS, parent=2)])
    await eventually(probe, [(1, 0, 3, 0, 0), (1, 1, 0, 0, 0)])


async def test_a_gap_is_replayed_from_the_engine(kv_app: Any, publisher: PublisherProcess) -> None:
    _, client = kv_app
    await register(client, publisher, 1, data_parallel_size=1,
                   kv_events_endpoints={"0": publisher.endpoints[0]},
                   replay_endpoint=publisher.replay_endpoints[0])  # fmt: skip
    probe = overlap(client)
    publisher.publish(0, [stored([1, 2], TOKENS[:8], BS)])
    await eventually(probe, [(1, 0, 2, 0, 0)])
    publisher.publish(0, [stored([3], TOKENS[8:12], BS, parent=2)], drop=True)
    publisher.publish(0, [stored([4], TOKENS[12:16], BS, parent=3)], drop=True)
    publisher.publish(0, [stored([5], TOKENS[16:20], BS, parent=4)])
    await eventually(probe, [(1, 0, 5, 0, 0)])
    assert await metric(client, "kv_slot_tracker_kv_events_replays") == 1
    assert await metric(client, "kv_slot_tracker_kv_events_replayed_batches") == 3
    assert await metric(client, "kv_slot_tracker_kv_events_gaps_lost") == 0


async def test_malformed_messages_are_counted_and_skipped(
    kv_app: Any, publisher: PublisherProcess
) -> None:
    _, client = kv_app
    await register(client, publisher, 1)
    probe = overlap(client)
    publisher.raw(0, [b"", b"\x00"])  # two frames
    publisher.raw(0, [b"", seq_frame(0), b"\xc1"])  # not msgpack
    publisher.raw(0, [b"", seq_frame(1), b"\x93\x00\x91\xa3bad\x00"])  # unknown event
    # vLLM's bytes hashes (sha256) are not 64-bit integers
    bad = [["BlockStored", [b"\x01" * 32], None, TOKENS[:4], BS, None, "GPU", None]]
    publisher.raw(0, [b"", seq_frame(2), __import__("msgpack").packb([0.0, bad, 0])])
    # a malformed batch consumes its sequence number: 3 follows without a gap
    good = encode_batch(0.0, [stored([1, 2], TOKENS[:8], BS)], 0)
    publisher.raw(0, [b"", seq_frame(3), good])
    await eventually(probe, [(1, 0, 2, 0, 0), (1, 1, 0, 0, 0)])
    assert await metric(client, "kv_slot_tracker_kv_events_malformed") == 4
    assert await metric(client, "kv_slot_tracker_kv_events_gaps") == 0


async def test_a_restarted_publisher_clears_the_rank_and_a_removed_worker_is_dropped(
    kv_app: Any, publisher: PublisherProcess
) -> None:
    _, client = kv_app
    await register(client, publisher, 1)
    probe = overlap(client)
    publisher.publish(0, [stored([1], TOKENS[:4], BS)])
    publisher.publish(0, [stored([2], TOKENS[4:8], BS, parent=1)])
    await eventually(probe, [(1, 0, 2, 0, 0), (1, 1, 0, 0, 0)])
    publisher.restart(0)
    publisher.publish(0, [stored([7], TOKENS[:4], BS)])  # sequence 0 again
    await eventually(probe, [(1, 0, 1, 0, 0), (1, 1, 0, 0, 0)])
    assert await metric(client, "kv_slot_tracker_kv_events_restarts") == 1
    r = await client.delete(PREFIX + "/workers/1")
    assert r.status_code == 200
    r = await client.post(PREFIX + "/overlap_scores", json={"token_ids": TOKENS})
    assert r.status_code == 503


async def test_selection_follows_the_engines_cache(
    kv_app: Any, publisher: PublisherProcess
) -> None:
    _, client = kv_app
    for wid, rank in ((1, 0), (2, 1)):
        r = await client.post(
            PREFIX + "/workers",
            json={"worker_id": wid, "endpoint": f"http://w{wid}", "block_size": BS,
                  "kv_events_endpoint": publisher.endpoints[rank]},
        )  # fmt: skip
        assert r.json()["lifecycle"] == "schedulable"
        await asyncio.to_thread(publisher.wait_subscribers, rank, 1)
    # worker 2 (publisher rank 1, its own dp rank 0) caches the prompt's first four blocks
    publisher.publish(1, [stored([5, 6, 7, 8], TOKENS[:16], BS)], dp_rank=0)
    probe = overlap(client)
    await eventually(probe, [(1, 0, 0, 0, 0), (2, 0, 4, 0, 0)])
    r = await client.post(PREFIX + "/select", json={"token_ids": TOKENS})
    body = r.json()
    assert (body["worker_id"], body["overlap"]["gpu"], body["effective_prefill_tokens"]) == (
        2, 16, 8,
    )  # fmt: skip
    # a booking does not write the index: only the engine's events do
    r = await client.post(PREFIX + "/select_and_reserve", json={"token_ids": TOKENS[:8]})
    assert r.status_code == 200
    assert await probe() == [(1, 0, 0, 0, 0), (2, 0, 4, 0, 0)]


async def test_a_publisher_away_or_silent_is_shown_and_its_worker_stays_schedulable() -> None:
    """As on the reference, a worker whose publisher has nothing listening, or goes away, stays
    schedulable and keeps its blocks; here ``/selection/ready`` and the metrics show it."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    settings = {"router_use_kv_events": True, "kv_events_silent_seconds": 0.3}
    async with running_app(FakeClock(), **settings) as (_, client):
        body = {"worker_id": 1, "endpoint": "http://w1", "block_size": BS,
                "kv_events_endpoint": endpoint}  # fmt: skip
        assert (await client.post(PREFIX + "/workers", json=body)).json()["lifecycle"] == (
            "schedulable"
        )

        async def kv(field: str) -> Any:
            r = await client.get(PREFIX + "/ready")
            assert r.status_code == 200  # a schedulable worker: ready, whatever its publisher
            return r.json()["kv_events"][field]

        async def connected() -> float:
            return await metric(
                client, 'kv_slot_tracker_kv_events_connected{dp_rank="0",worker_id="1"}'
            )

        await eventually(lambda: kv("listening_ranks"), 1)
        assert await kv("disconnected_ranks") == [[1, 0]]  # nothing listens there
        assert await connected() == 0
        await eventually(lambda: kv("silent_ranks"), [[1, 0]])

        ctx = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(endpoint)
        try:
            await eventually(lambda: kv("disconnected_ranks"), [])
            assert await connected() == 1
            probe = overlap(client)
            while await probe() != [(1, 0, 3, 0, 0)]:  # until the subscription has reached it
                pub.send_multipart([b"", seq_frame(0), encode_batch(0.0, [
                    stored([11, 12, 13], TOKENS[:12], BS)])])  # fmt: skip
                await asyncio.sleep(0.05)
            assert await kv("silent_ranks") == []
        finally:
            pub.close(0)
            ctx.term()
        await eventually(lambda: kv("disconnected_ranks"), [[1, 0]])
        await eventually(lambda: kv("silent_ranks"), [[1, 0]])
        worker = (await client.get(PREFIX + "/workers")).json()[0]
        assert worker["lifecycle"] == "schedulable"
        assert await probe() == [(1, 0, 3, 0, 0)]  # its blocks stay, as on the reference


async def test_a_drained_burst_gives_the_c_heap_back() -> None:
    """After a burst of messages (libzmq queued them in C buffers while the loop caught up), the
    heap's free pages are handed back once no listener has had a message for a second: once per
    burst of ``TRIM_AFTER_BYTES`` received, never while messages still arrive."""
    from kv_slot_tracker.gc_tuning import release_free_memory
    from kv_slot_tracker.ingest.zmq import TRIM_AFTER_BYTES, TRIM_QUIET_S, ZmqIngest

    assert release_free_memory() is True  # glibc here: the call exists
    ingest = ZmqIngest(sink=None)  # type: ignore[arg-type]  # the sink is not reached
    busy = type("Listener", (), {"last_message_at": 100.0})()
    ingest.listeners[(1, 0)] = (None, busy, None)  # type: ignore[assignment]
    try:
        ingest.counters.bytes = TRIM_AFTER_BYTES - 1
        ingest._trim_after_burst(200.0)  # noqa: SLF001
        assert ingest.counters.heap_trims == 0  # no burst yet
        ingest.counters.bytes = TRIM_AFTER_BYTES
        ingest._trim_after_burst(100.0 + TRIM_QUIET_S / 2)  # noqa: SLF001
        assert ingest.counters.heap_trims == 0  # still receiving
        ingest._trim_after_burst(100.0 + TRIM_QUIET_S)  # noqa: SLF001
        assert ingest.counters.heap_trims == 1
        ingest._trim_after_burst(500.0)  # noqa: SLF001
        assert ingest.counters.heap_trims == 1  # once per burst
        ingest.counters.bytes = 2 * TRIM_AFTER_BYTES
        ingest._trim_after_burst(500.0)  # noqa: SLF001
        assert ingest.counters.heap_trims == 2
    finally:
        ingest.ctx.destroy(linger=0)
