"""The KV-event listener against a publisher speaking the engines' framing (``fake_engine``).

Real ZMQ sockets on 127.0.0.1 (or ipc), a real app with KV events on, the index read through
``/selection/overlap_scores`` and the counters through ``/metrics``. Each gap scenario runs under
both ``kv_events_gap_policy`` values; where they differ the reference's way is ``continue``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.api.conftest import running_app
from tests.fakes import FakeClock

from .fake_engine import BS, TOKENS, FakeEngine, chain, removed, stored

PREFIX = "/selection"
POLICIES = ["continue", "clear"]


async def app_with(**settings: Any) -> Any:
    return running_app(FakeClock(), router_use_kv_events=True, **settings)


async def eventually(probe: Callable[[], Any], want: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    got = None
    while time.monotonic() < deadline:
        got = await probe()
        if got == want:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"still {got!r}, wanted {want!r}")


def blocks(client: httpx.AsyncClient) -> Callable[[], Any]:
    """The device blocks of ``TOKENS`` each (worker, dp rank) holds, as ``/overlap_scores``."""

    async def probe() -> list[tuple[int, int, int]]:
        r = await client.post(PREFIX + "/overlap_scores", json={"token_ids": TOKENS})
        assert r.status_code == 200, r.text
        return sorted(
            (w["worker_id"], w["dp_rank"], w["device_blocks"]) for w in r.json()["workers"]
        )

    return probe


async def register(client: httpx.AsyncClient, engine: FakeEngine, wid: int = 1, *,
                   replay: bool = True, **extra: Any) -> None:  # fmt: skip
    body = {"worker_id": wid, "endpoint": f"http://w{wid}", "block_size": BS,
            "kv_events_endpoint": engine.endpoint, **extra}  # fmt: skip
    if replay and engine.replay_endpoint:
        body["replay_endpoint"] = engine.replay_endpoint
    r = await client.post(PREFIX + "/workers", json=body)
    assert r.status_code == 201, r.text
    assert r.json()["lifecycle"] == "schedulable", r.json()
    await asyncio.to_thread(engine.wait_subscribed)


async def metrics(client: httpx.AsyncClient) -> dict[str, float]:
    out = {}
    for line in (await client.get("/metrics")).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def warning(kind: str) -> str:
    return f'kv_slot_tracker_kv_cache_event_warnings_total{{warning_kind="{kind}"}}'


async def publish_all(engine: FakeEngine, batches: list[list], **kw: Any) -> None:
    for events in batches:
        engine.publish(events, **kw)


# -- replay framing and the gap scenarios ----------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("legacy", [False, True], ids=["engine-framing", "3-frame"])
async def test_a_late_joiner_is_replayed_from_the_engine(
    engines: Any, policy: str, legacy: bool
) -> None:
    """Four batches published before the listener joined; the fifth shows the gap and the
    replay (the engines' ``[b"", topic, seq, payload]`` answers) brings all four."""
    engine = engines(topic=b"kv", legacy=legacy)
    batches = chain(5)
    async with await app_with(kv_events_gap_policy=policy) as (_, client):
        for events in batches[:4]:
            engine.publish(events, send=False)  # before anyone listened
        await register(client, engine)
        engine.publish(batches[4])
        await eventually(blocks(client), [(1, 0, 5)])
        m = await metrics(client)
        assert engine.replay_requests == [0]
        assert m["kv_slot_tracker_kv_events_replays_total"] == 1
        # the engine answers with its whole buffer from 0: batch 4 too (the live 4 is then stale)
        assert m["kv_slot_tracker_kv_events_replayed_batches_total"] == 5
        assert m[warning("stale")] == 1
        assert m["kv_slot_tracker_kv_events_gaps_lost_total"] == 0
        assert m["kv_slot_tracker_kv_events_malformed_total"] == 0
        assert (
            m['kv_slot_tracker_kv_cache_events_applied_total{event_type="stored",status="ok"}'] == 5
        )


@pytest.mark.parametrize("policy", POLICIES)
async def test_a_skipped_number_the_replay_cannot_fill(engines: Any, policy: str) -> None:
    """Batch 2 lost and gone from the engine's buffer: "Replay incomplete". ``continue`` keeps
    the rank's blocks and carries on (the reference); ``clear`` forgets them."""
    engine = engines()
    async with await app_with(kv_events_gap_policy=policy) as (_, client):
        await register(client, engine)
        batches = chain(4)
        engine.publish(batches[0])
        engine.publish(batches[1])
        await eventually(blocks(client), [(1, 0, 2)])
        engine.publish(batches[2], send=False)
        engine.forget(3)
        engine.publish([stored([99], 5)])  # a block of its own, no parent
        engine.publish(batches[3])  # parent 3 never arrived: refused
        probe = blocks(client)
        m: dict[str, float] = {}

        async def lost() -> float:
            nonlocal m
            m = await metrics(client)
            return m.get(warning("replay_incomplete"), 0)

        await eventually(lost, 1)
        await eventually(lambda: _applied(client), 3 + 1)
        assert await probe() == ([(1, 0, 2)] if policy == "continue" else [(1, 0, 0)])
        assert engine.replay_requests == [2]
        assert m[warning("gap_cleared")] == (0 if policy == "continue" else 1)
        assert m["kv_slot_tracker_kv_events_gaps_lost_total"] == 1


async def _applied(client: httpx.AsyncClient) -> float:
    m = await metrics(client)
    return sum(
        v for k, v in m.items() if k.startswith("kv_slot_tracker_kv_cache_events_applied_total")
    )


@pytest.mark.parametrize("policy", POLICIES)
async def test_a_skipped_number_without_replay(engines: Any, policy: str) -> None:
    engine = engines(replay=False)
    async with await app_with(kv_events_gap_policy=policy) as (_, client):
        await register(client, engine)
        batches = chain(5)
        for events in batches[:3]:
            engine.publish(events)
        await eventually(blocks(client), [(1, 0, 3)])
        engine.publish(batches[3], send=False)
        engine.publish([stored([1], 0)])  # block 0 again: a store the index already holds
        await eventually(lambda: _applied(client), 4)
        m = await metrics(client)
        assert m[warning("gap")] == 1
        assert m[warning("replay_incomplete")] == 1
        if policy == "continue":
            assert await blocks(client)() == [(1, 0, 3)]
        else:
            assert await blocks(client)() == [(1, 0, 1)]  # cleared, then block 0 again


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no-replay"])
async def test_a_dropped_connection(engines: Any, tmp_path: Any, policy: str, replay: bool) -> None:
    """The engine's PUB socket closes and binds again (same address): what it published while
    no one was connected is a gap, replayed when it can be."""
    engine = engines(ipc_dir=str(tmp_path), replay=replay)
    async with await app_with(kv_events_gap_policy=policy) as (_, client):
        await register(client, engine)
        batches = chain(4)
        engine.publish(batches[0])
        engine.publish(batches[1])
        await eventually(blocks(client), [(1, 0, 2)])
        engine.kill_pub()
        engine.publish(batches[2], send=False)  # published while the socket was down
        engine.revive_pub()
        await asyncio.to_thread(engine.wait_subscribed)
        engine.publish(batches[3])
        if replay:
            await eventually(blocks(client), [(1, 0, 4)])
        else:
            await eventually(lambda: _applied(client), 3)
            # carries on: block 3's parent never came, so only the first two stay (continue);
            # the rank is forgotten (clear)
            assert await blocks(client)() == ([(1, 0, 2)] if policy == "continue" else [(1, 0, 0)])


@pytest.mark.parametrize("policy", POLICIES)
async def test_a_restarted_publisher_clears_the_rank(engines: Any, policy: str) -> None:
    """Divergence from the reference (which keeps the old blocks and skips the new batches
    until their numbers pass the old ones): an engine starting at 0 has an empty cache."""
    engine = engines()
    async with await app_with(kv_events_gap_policy=policy) as (_, client):
        await register(client, engine)
        for events in chain(3):
            engine.publish(events)
        await eventually(blocks(client), [(1, 0, 3)])
        engine.restart()
        engine.publish([stored([1], 0)])  # sequence 0 again: 3 blocks -> 1
        await eventually(blocks(client), [(1, 0, 1)])
        engine.publish([stored([2], 1, parent=1)])
        await eventually(blocks(client), [(1, 0, 2)])
        m = await metrics(client)
        assert m["kv_slot_tracker_kv_events_restarts_total"] == 1
        assert m[warning("stale")] == 0


async def _batches(client: httpx.AsyncClient) -> float:
    return (await metrics(client))["kv_slot_tracker_kv_events_batches_total"]


@pytest.mark.parametrize("one_batch", [False, True], ids=["two-batches", "one-batch"])
async def test_a_restarted_engine_indexes_the_same_tokens_under_new_hashes(
    engines: Any, one_batch: bool
) -> None:
    """An engine restarted stores the same tokens under new hashes (vLLM seeds them per
    process): the runs nobody holds after the restart's clear are dropped, so the new chain is
    indexed whole (kept, a stale run would take the first block and refuse the second)."""
    engine = engines()
    async with await app_with() as (_, client):
        await register(client, engine)
        engine.publish([stored([1], 0)])
        engine.publish([stored([2], 1, parent=1)])
        await eventually(blocks(client), [(1, 0, 2)])
        engine.restart()
        new = [stored([50], 0), stored([51], 1, parent=50)]
        await publish_all(engine, [new] if one_batch else [[e] for e in new])
        await eventually(lambda: _batches(client), 3 if one_batch else 4)
        assert await blocks(client)() == [(1, 0, 2)]
        m = await metrics(client)
        assert m["kv_slot_tracker_kv_events_restarts_total"] == 1
        assert m["kv_slot_tracker_kv_events_stores_refused_total"] == 0


async def test_a_restarted_engine_joins_a_run_another_rank_still_holds(engines: Any) -> None:
    """As the reference: while another rank holds the old run (under the old hashes), the new
    hashes join it for the first block and the next store is refused (stale parent)."""
    engine, other = engines(), engines()
    async with await app_with() as (_, client):
        await register(client, engine)
        await register(client, other, wid=2)
        for e in (engine, other):
            e.publish([stored([1], 0)])
            e.publish([stored([2], 1, parent=1)])
        await eventually(blocks(client), [(1, 0, 2), (2, 0, 2)])
        engine.restart()
        engine.publish([stored([50], 0)])
        engine.publish([stored([51], 1, parent=50)])
        await eventually(lambda: _batches(client), 6)
        assert await blocks(client)() == [(1, 0, 1), (2, 0, 2)]


async def test_a_worker_deleted_and_back_under_new_hashes_indexes_them(engines: Any) -> None:
    """A worker removed and registered again (its engine restarted, new sockets and hashes):
    the runs it alone held are dropped with it, the new chain is indexed whole (Dynamo 1.6.1
    keeps the runs and credits one block)."""
    engine = engines()
    async with await app_with() as (_, client):
        await register(client, engine)
        engine.publish([stored([1], 0)])
        engine.publish([stored([2], 1, parent=1)])
        await eventually(blocks(client), [(1, 0, 2)])
        r = await client.delete(PREFIX + "/workers/1")
        assert r.status_code in (200, 204), r.text
        again = engines()
        await register(client, again)
        again.publish([stored([50], 0)])
        again.publish([stored([51], 1, parent=50)])
        await eventually(lambda: _batches(client), 4)
        assert await blocks(client)() == [(1, 0, 2)]


async def test_all_blocks_cleared_keeps_the_runs_nobody_holds_as_the_reference(
    engines: Any,
) -> None:
    """``AllBlocksCleared`` from the engine (same process, same numbering) keeps the runs as
    the reference does (1.6.1, verified): the same tokens under new hashes join the old run
    for one block and the continuation is refused."""
    engine = engines()
    async with await app_with() as (_, client):
        await register(client, engine)
        engine.publish([stored([1], 0)])
        engine.publish([stored([2], 1, parent=1)])
        await eventually(blocks(client), [(1, 0, 2)])
        engine.publish([["AllBlocksCleared"]])
        engine.publish([stored([50], 0)])
        engine.publish([stored([51], 1, parent=50)])
        await eventually(lambda: _batches(client), 5)
        assert await blocks(client)() == [(1, 0, 1)]


async def test_one_replay_endpoint_for_several_ranks_is_incomplete(engines: Any) -> None:
    engine = engines()
    async with await app_with() as (_, client):
        body = {"worker_id": 3, "endpoint": "http://w3", "block_size": BS,
                "data_parallel_size": 2, "replay_endpoint": engine.replay_endpoint,
                "kv_events_endpoints": {"0": engine.endpoint, "1": engine.endpoint}}  # fmt: skip
        r = await client.post(PREFIX + "/workers", json=body)
        assert r.status_code == 201
        assert r.json()["lifecycle"] == "incomplete"
        assert r.json()["not_schedulable_reasons"] == [
            "replay_endpoint is supported only for data_parallel_size 1"
        ]
        body["data_parallel_size"] = 1
        body["kv_events_endpoints"] = {"0": engine.endpoint}
        r = await client.post(PREFIX + "/workers", json=body)
        assert r.json()["lifecycle"] == "schedulable", r.json()
    # KV events off: the rule is the ingest's, as on the reference
    async with running_app(FakeClock(), router_use_kv_events=False) as (_, client):
        body["data_parallel_size"] = 2
        r = await client.post(PREFIX + "/workers", json=body)
        assert r.json()["lifecycle"] == "schedulable"


# -- what a publisher (or anyone reaching the socket) can send --------------------------------


async def test_garbage_never_clears_the_rank_and_is_logged_sparingly(
    engines: Any, caplog: pytest.LogCaptureFixture
) -> None:
    engine = engines(replay=False)
    async with await app_with(kv_events_gap_policy="clear") as (_, client):
        await register(client, engine)
        batches = chain(3)
        engine.publish(batches[0])
        engine.publish(batches[1])
        await eventually(blocks(client), [(1, 0, 2)])
        caplog.set_level(logging.WARNING, logger="kv_slot_tracker.ingest.listener")
        for _ in range(300):
            engine.raw([b"", b"\x00"])  # two frames
            engine.raw([b"", b"short", b"x"])  # a sequence frame of 5 bytes
        for seq in range(2, 202):  # numbers that do decode, payloads that do not
            engine.raw([b"", seq.to_bytes(8, "big"), b"\xc1" * (seq % 7)])
        engine.publish(batches[2], seq=202)  # continues from 201: no gap

        async def seen() -> float:
            return (await metrics(client)).get("kv_slot_tracker_kv_events_malformed_total", 0)

        await eventually(seen, 800)
        await eventually(blocks(client), [(1, 0, 3)])
        m = await metrics(client)
        assert m[warning("malformed_frames")] == 300
        assert m[warning("malformed_seq")] == 300
        assert m[warning("malformed_payload")] == 200
        assert m[warning("gap")] == 0
        assert m[warning("gap_cleared")] == 0
        lines = [r for r in caplog.records if "malformed" in r.getMessage()]
        assert len(lines) == 3  # one per kind in the interval


async def test_a_batch_naming_another_rank_is_rejected(engines: Any) -> None:
    engine = engines(replay=False)
    async with await app_with() as (_, client):
        await register(client, engine)
        for rank in range(10, 60):
            engine.publish([stored([rank], 0)], dp_rank=rank)
        engine.publish(chain(1)[0], dp_rank=None)  # no rank: the socket's
        await eventually(blocks(client), [(1, 0, 1)])
        m = await metrics(client)
        assert m[warning("dp_rank_out_of_range")] == 50
        assert m["kv_slot_tracker_kv_events_batches_total"] == 1


async def test_a_sequence_number_that_cannot_be_right_does_not_blind_the_rank(
    engines: Any,
) -> None:
    engine = engines(replay=False)
    async with await app_with(kv_events_max_seq_jump=1000) as (_, client):
        await register(client, engine)
        batches = chain(6)
        engine.publish(batches[0])
        engine.publish(batches[1])
        engine.publish([stored([77], 0)], seq=(1 << 64) - 1)  # held, then dropped
        engine.publish(batches[2], seq=2)
        engine.publish(batches[3], seq=3)
        await eventually(blocks(client), [(1, 0, 4)])
        m = await metrics(client)
        assert m[warning("seq_out_of_line")] == 1
        assert m[warning("stale")] == 0
        # a real jump is confirmed by the next batch: a gap from the old numbering
        engine.publish(batches[4], seq=50_000)
        engine.publish(batches[5], seq=50_001)
        await eventually(lambda: _gap_count(client), 1)
        await eventually(blocks(client), [(1, 0, 4)])  # batch 50,000 was dropped: 5 is refused
        engine.publish([stored([5], 4, parent=4)], seq=50_002)
        await eventually(blocks(client), [(1, 0, 5)])
        # and a number far behind, confirmed by the next, is a restart: the rank is cleared
        engine.publish([stored([1], 0)], seq=7)  # held, dropped
        engine.publish([stored([2], 1, parent=1)], seq=8)  # confirms: parent 1 unknown now
        await eventually(blocks(client), [(1, 0, 0)])
        engine.publish([stored([1], 0)], seq=9)
        await eventually(blocks(client), [(1, 0, 1)])
        m = await metrics(client)
        assert m["kv_slot_tracker_kv_events_restarts_total"] == 1


async def test_a_replay_answer_out_of_line_is_not_applied(engines: Any) -> None:
    engine = engines()
    async with await app_with(kv_events_max_seq_jump=1000) as (_, client):
        await register(client, engine)
        batches = chain(4)
        engine.publish(batches[0])
        await eventually(blocks(client), [(1, 0, 1)])
        engine.publish(batches[1], send=False)
        engine.publish([stored([77], 9)], send=False, seq=(1 << 64) - 1)  # in the buffer
        engine.publish(batches[2])  # seq 2: the gap at 1 is replayed: 1, then 2^64-1
        engine.publish(batches[3])
        await eventually(blocks(client), [(1, 0, 4)])
        m = await metrics(client)
        assert m[warning("seq_out_of_line")] == 1
        assert m[warning("stale")] == 0
        assert m["kv_slot_tracker_kv_events_restarts_total"] == 0


async def _gap_count(client: httpx.AsyncClient) -> float:
    return (await metrics(client)).get(warning("gap"), 0)


async def test_an_oversized_message_is_counted_and_the_listener_comes_back(engines: Any) -> None:
    engine = engines(replay=False)
    async with await app_with(kv_events_max_message_bytes=4096) as (_, client):
        await register(client, engine)
        engine.publish(chain(1)[0])
        await eventually(blocks(client), [(1, 0, 1)])
        engine.raw([b"", (1).to_bytes(8, "big"), b"\x00" * 10_000])  # libzmq drops the link

        async def reconnects() -> float:
            return (await metrics(client)).get("kv_slot_tracker_kv_events_reconnects_total", 0)

        await eventually(reconnects, 1)
        await asyncio.to_thread(engine.wait_subscribed)
        engine.publish(chain(2)[1], seq=2)
        await eventually(blocks(client), [(1, 0, 2)])
        assert (await metrics(client))[warning("connection_dropped")] == 1


async def test_a_batch_over_the_cap_is_rejected_and_a_large_one_applied(engines: Any) -> None:
    engine = engines(replay=False)
    async with await app_with(kv_events_max_batch_blocks=3000) as (_, client):
        await register(client, engine)
        tokens = [t % 50_000 for t in range(3001 * BS)]
        big = list(range(1000, 4001))  # 3001 blocks
        engine.publish([["BlockStored", big, None, tokens, BS, None, "GPU", None]])
        ok = list(range(1, 3001))  # 3000 blocks: applied (in slices)
        engine.publish([["BlockStored", ok, None, tokens[: 3000 * BS], BS, None, "GPU", None]])
        engine.publish([removed(ok[2000:])])
        await eventually(lambda: _applied(client), 2)
        m = await metrics(client)
        assert m[warning("batch_too_large")] == 1
        indexed = [v for k, v in m.items() if k.startswith("kv_slot_tracker_kv_indexed_blocks")]
        assert indexed == [2000]


async def test_the_field_named_metrics_and_listener_states(engines: Any) -> None:
    engine = engines(replay=False)
    async with await app_with(kv_events_silent_seconds=0.2) as (_, client):
        await register(client, engine)
        engine.publish(chain(1)[0])
        engine.publish([removed([1])])
        engine.publish([["AllBlocksCleared"]])
        engine.publish([stored([5], 1, parent=4)])  # unknown parent: refused
        await eventually(lambda: _applied(client), 4)
        m = await metrics(client)
        applied = "kv_slot_tracker_kv_cache_events_applied_total"
        assert m[f'{applied}{{event_type="stored",status="ok"}}'] == 1
        assert m[f'{applied}{{event_type="stored",status="refused"}}'] == 1
        assert m[f'{applied}{{event_type="removed",status="ok"}}'] == 1
        assert m[f'{applied}{{event_type="cleared",status="ok"}}'] == 1

        async def states() -> tuple[float, float, float]:
            m = await metrics(client)
            return tuple(m[f'kv_slot_tracker_kv_events_listeners{{status="{s}"}}']
                         for s in ("active", "silent", "disconnected"))  # fmt: skip

        await eventually(states, (0, 1, 0))  # nothing for 0.2 s
        engine.kill_pub()
        await eventually(states, (0, 0, 1))


async def test_large_batches_leave_the_loop_turns(engines: Any) -> None:
    """A batch of many blocks is applied in slices: a task of the loop runs between them."""
    from kv_slot_tracker.ingest.slices import SLICE_BLOCKS

    engine = engines(replay=False)
    async with await app_with() as (app, client):
        await register(client, engine)
        service = app.state.selection.kv_events
        calls: list[int] = []
        ticks = 0
        real = service.apply_kv_batch

        def spy(wid: int, rank: int, batch: Any) -> None:
            calls.append(ticks)
            real(wid, rank, batch)

        service.apply_kv_batch = spy
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        n = 3 * SLICE_BLOCKS + 1
        tokens = [t % 50_000 for t in range(n * BS)]
        engine.publish(
            [["BlockStored", list(range(1, n + 1)), None, tokens, BS, None, "GPU", None]]
        )

        async def indexed() -> list[float]:
            m = await metrics(client)
            return [v for k, v in m.items() if k.startswith("kv_slot_tracker_kv_indexed_blocks")]

        try:
            await eventually(indexed, [n])
        finally:
            stop.set()
            await task
        assert len(calls) == 4
        assert calls == sorted(calls) and len(set(calls)) == 4  # the ticker ran in between
