"""Whole applications sharing their state through the supervisor's hub
(``kv_slot_tracker.replication.local``), in this process, driven over ASGI: what one process
acknowledges, the next call on its sibling finds (durable acknowledgements + read barrier); a
process that joins after the hub forgot the first frames loads a sibling's state; ``GET
/replication`` says mode ``local`` with its position."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kv_slot_tracker.main import create_app
from kv_slot_tracker.replication.local import framing
from kv_slot_tracker.replication.local.hub import Hub
from kv_slot_tracker.settings import Settings
from tests.replication.apps import App, register, until


def settings(instance_id: int, ack: str = "redis", **extra: Any) -> Settings:
    return Settings(instance_id=instance_id, replication_ack=ack, redis_url="", **extra)


@contextlib.asynccontextmanager
async def started(
    stack: contextlib.AsyncExitStack, hub: Hub, instance_id: int, ack: str = "redis", **extra: Any
) -> AsyncIterator[App]:
    app = create_app(settings(instance_id, ack, **extra), hub_socket=hub.path)
    await stack.enter_async_context(app.router.lifespan_context(app))
    await app.state.replication.settled(10)
    client = await stack.enter_async_context(
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=30)
    )
    yield App(app, client)


@pytest.fixture
async def hub(tmp_path: Path) -> AsyncIterator[Hub]:
    h = Hub(tmp_path / "hub.sock")
    await h.start()
    try:
        yield h
    finally:
        await h.stop()


async def test_siblings_answer_as_one_and_a_late_one_loads_the_state(hub: Hub) -> None:
    async with contextlib.AsyncExitStack() as stack:
        a = await stack.enter_async_context(started(stack, hub, 1))
        b = await stack.enter_async_context(started(stack, hub, 2))
        assert a.replication.ready() and b.replication.ready()
        await register(a, [b])
        # each call of a request on the other process, at once: the add acknowledged by the
        # hub on one, the next call on the other finds it (read barrier)
        for i in range(10):
            first, second = (a, b) if i % 2 == 0 else (b, a)
            assert await first.add(f"r{i}") == 201
            assert (await second.call("prefill_complete", f"r{i}")).status_code == 200
        for i in range(0, 10, 2):
            assert (await b.call("free", f"r{i}")).status_code == 200
        assert (await a.call("prefill_complete", "nowhere")).status_code == 404
        await until(lambda: a.outbox_empty() and b.outbox_empty(), what="outboxes sequenced")
        await until(lambda: hub.retained.first > 1, what="the hub forgetting applied frames")
        want = await a.loads()
        assert await b.loads() == want
        assert sum(row["active_requests"] for row in want) == 5

        # a third process joins: the first frames are gone, so a sibling's state is the way
        c = await stack.enter_async_context(started(stack, hub, 3))
        assert c.replication.ready() and hub.counters.exports == 1
        assert await c.loads() == want
        assert (await c.call("free", "r1")).status_code == 200  # an add made on a, freed here
        await until(lambda: c.outbox_empty(), what="c's free sequenced")
        await until(_same([a, b, c]), what="the three alike")

        status = (await c.client.get("/replication")).json()
        assert status["mode"] == "local" and status["ready"] and status["connected"]
        assert status["bootstraps"] == 1 and int(status["stream_position"]) == hub.head
        assert status["published"] == 1 and status["dropped"] == 0
        # the hub's figures reach every process (once a second)
        await until(lambda: (c.replication.status().hub or {}).get("processes") == 3,
                    what="the hub's figures")  # fmt: skip
        figures = c.replication.status().hub
        assert figures == {**hub.stats(), "kept_bytes": figures["kept_bytes"],
                           "kept_from": figures["kept_from"]}  # fmt: skip
        assert figures["head"] == hub.head and figures["exports"] == 1 and figures["joins"] == 3
        assert figures["oversized"] == figures["cut"] == figures["resyncs"] == 0
        assert c.metric("replication_position") == hub.head
        assert c.metric("supervisor_hub_head") == hub.head
        # a: the registration, its 5 adds and the 5 prefill completions of b's adds
        assert a.replication.status().published == 11
        assert c.metric("replication_published_total") == 1


async def test_by_default_unknown_ids_are_answered_as_one_process_answers_them(hub: Hub) -> None:
    """``replication_ack = "auto"`` (the default) acknowledges through the hub, so after the read
    barrier an id nowhere is certainly unknown and every lifecycle call is answered as one
    process answers it (and as the reference does), at once rather than after
    ``consistency_wait_ms``."""
    async with contextlib.AsyncExitStack() as stack:
        a = await stack.enter_async_context(started(stack, hub, 1, "local"))
        b = await stack.enter_async_context(started(stack, hub, 2, "local"))
        await register(a, [b])
        assert await a.add("r1") == 201
        assert (await b.call("prefill_complete", "r1")).status_code == 200  # the barrier
        r = await b.call("prefill_complete", "nowhere")
        assert (r.status_code, r.json()) == (404, {"error": "Request nowhere not found"})
        assert (await b.call("free", "nowhere")).status_code == 200  # as one process: a no-op
        r = await b.post("/free", {"model_name": "other", "request_id": "r1"})
        assert (r.status_code, r.json()) == (
            404, {"error": "no slot tracker for model=other routing_group=default"}
        )  # fmt: skip
        r = await b.post("/prefill_complete", {"model_name": "other", "request_id": "r1"})
        assert r.status_code == 404, r.text
        # the free still left a tombstone: an add of that id made before it, whose record
        # arrives later (answered 503 on its process), is cancelled everywhere
        assert b.metric("consistency_tombstones_created_total") == 2
        assert b.metric("consistency_marks_created_total") == 0
        assert (await b.call("free", "r1")).status_code == 200
        await until(_same([a, b]), what="both alike")
        assert sum(row["active_requests"] for row in await a.loads()) == 0

        # calls waiting at once share barriers: the first asks, those arriving meanwhile share
        # the next (each costs every sibling a flush), and every one is still answered right
        before = hub.counters.barriers
        answers = await asyncio.gather(*(b.call("prefill_complete", f"no{i}") for i in range(20)))
        assert [r.status_code for r in answers] == [404] * 20
        assert hub.counters.barriers - before <= 3


async def test_the_barrier_has_a_sibling_send_what_it_acknowledged(hub: Hub) -> None:
    """With local acknowledgements a process answers an add before its record leaves (here the
    record would wait 5 s in its outbox): a sibling's read barrier has it sent first, so a call
    on the sibling finds the request (neither a pending mark nor a 404)."""
    async with contextlib.AsyncExitStack() as stack:
        b = await stack.enter_async_context(started(stack, hub, 2, "local"))
        a = await stack.enter_async_context(
            started(stack, hub, 1, "local", replication_batch_ms=5000)
        )
        await register(b, [a])
        assert await a.add("held") == 201
        assert a.replication.status().outbox_depth == 1  # not sent yet
        assert (await b.call("prefill_complete", "held")).status_code == 200
        assert a.replication.status().outbox_depth == 0  # sent for the barrier
        assert b.metric("consistency_marks_created_total") == 0
        assert b.metric("consistency_barrier_timeouts_total") == 0
        assert (await b.call("free", "held")).status_code == 200
        assert b.metric("consistency_tombstones_created_total") == 0


async def test_a_state_larger_than_a_piece_loads_whole(
    hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The state a joining process loads travels in pieces (here of 100 bytes: about a hundred
    of them each way) and arrives whole."""
    monkeypatch.setattr(framing, "STATE_PIECE_BYTES", 100)
    async with contextlib.AsyncExitStack() as stack:
        a = await stack.enter_async_context(started(stack, hub, 1))
        await register(a, [])
        for i in range(20):
            assert await a.add(f"r{i}", rank=i % 2) == 201
        await until(lambda: a.outbox_empty() and hub.retained.first > 1,
                    what="the hub forgetting applied frames")  # fmt: skip
        b = await stack.enter_async_context(started(stack, hub, 2))
        assert b.replication.ready() and hub.counters.exports == 1
        want = await a.loads()
        assert await b.loads() == want and sum(r["active_requests"] for r in want) == 20
        assert (await b.call("free", "r3")).status_code == 200
        await until(_same([a, b]), what="both alike")


def _same(apps: list[App]):  # type: ignore[no-untyped-def]
    async def check() -> bool:
        views = [await app.loads() for app in apps]
        return all(v == views[0] for v in views)

    return check


async def test_a_process_cut_off_from_the_hub_loads_the_state_again_keeping_its_own(
    hub: Hub,
) -> None:
    """The hub drops a process's connection (as it does for a bad frame): the process connects
    again, loads its sibling's state (which lacks what the process accepted meanwhile) and
    still ends with its own changes, applied again when the hub sequences them."""
    local = Settings(instance_id=2, replication_ack="local", redis_url="")
    async with contextlib.AsyncExitStack() as stack:
        a = await stack.enter_async_context(started(stack, hub, 1))
        app = create_app(local, hub_socket=hub.path)
        await stack.enter_async_context(app.router.lifespan_context(app))
        await app.state.replication.settled(10)
        client = await stack.enter_async_context(
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        )
        b = App(app, client)
        await register(a, [b])
        assert await b.add("before") == 201
        await until(lambda: b.outbox_empty(), what="b's add sequenced")
        await until(lambda: hub.retained.first > 2, what="the hub forgetting applied frames")

        [conn] = [c for c in hub.connections if c.instance_id == 2]
        conn.close()
        await until(lambda: not b.replication.connected(), what="b cut off")
        assert await b.add("meanwhile") == 201  # accepted here, not sent yet
        assert b.replication.status().outbox_depth == 1
        await until(lambda: b.replication.connected() and b.outbox_empty(), what="b back")
        await until(_same([a, b]), what="both alike")
        rows = await b.loads()
        assert sum(row["active_requests"] for row in rows) == 2
        status = b.replication.status()
        assert status.bootstraps == 2 and status.dropped == 0
        assert hub.counters.exports == 1


async def test_a_process_behind_the_frames_kept_loads_the_state_again(tmp_path: Path) -> None:
    """A process that stops reading while its sibling keeps changing things falls behind the
    (small) bytes the hub keeps: told to resync, it loads the sibling's state and ends with
    everything, its own change made meanwhile included."""
    hub = Hub(tmp_path / "small.sock", max_retained_bytes=32 * 1024, write_high_water=8 * 1024)
    await hub.start()
    try:
        async with contextlib.AsyncExitStack() as stack:
            a = await stack.enter_async_context(started(stack, hub, 1, "local"))
            b = await stack.enter_async_context(started(stack, hub, 2, "local"))
            await register(a, [b])
            b.replication._link.transport.pause_reading()  # b reads nothing from the hub
            assert await b.add("b-own") == 201  # sent, sequenced; its echo unread
            for n in range(20):  # ~1 MB of records: beyond the socket, b's buffer and the bound
                ops = [{"op": "add", "model_name": "m", "request_id": f"a{n}-{i}", "worker_id": 1,
                        "dp_rank": i % 2, "sequence_hashes": list(range(i, i + 200)),
                        "new_isl_tokens": 10} for i in range(50)]  # fmt: skip
                assert (await a.post("/batch", {"operations": ops})).status_code == 200
            await until(lambda: hub.counters.resyncs == 1, what="b told to resync")
            b.replication._link.transport.resume_reading()
            await until(lambda: b.replication.status().bootstraps == 2, what="b reloaded")
            await until(lambda: a.outbox_empty() and b.outbox_empty(), what="all sequenced")
            await until(_same([a, b]), what="both alike")
            rows = await b.loads()
            assert sum(row["active_requests"] for row in rows) == 20 * 50 + 1
            status = b.replication.status()
            assert status.resets == 1 and status.dropped == 0 and status.ready
    finally:
        await hub.stop()


async def test_processes_that_all_ended_get_the_state_back_from_the_hub(tmp_path: Path) -> None:
    hub = Hub(tmp_path / "snap.sock", snapshot_every_s=0.2)
    await hub.start()
    try:
        async with contextlib.AsyncExitStack() as stack:
            a = await stack.enter_async_context(started(stack, hub, 1))
            b = await stack.enter_async_context(started(stack, hub, 2))
            await register(a, [b])
            for i in range(6):
                assert await (a if i % 2 else b).add(f"r{i}") == 201
            assert (await a.call("free", "r0")).status_code == 200
            want = await a.loads()
            await until(lambda: hub.snapshot is not None and hub.snapshot[0] >= 4,
                        what="a snapshot after some of the changes")  # fmt: skip
            assert (await b.call("free", "r1")).status_code == 200  # after the snapshot
            want = await b.loads()
        await until(lambda: not hub.connections, what="both ended")
        async with contextlib.AsyncExitStack() as stack:
            c = await stack.enter_async_context(started(stack, hub, 3))
            assert c.replication.ready()
            assert await c.loads() == want
            assert sum(row["active_requests"] for row in want) == 4
            assert hub.counters.snapshot_joins == 1 and hub.counters.lost_joins == 0
    finally:
        await hub.stop()
