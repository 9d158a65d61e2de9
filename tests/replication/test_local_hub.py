"""The workers hub (``kv_slot_tracker.replication.local.hub``) on a real Unix socket, with
clients that speak its frames byte by byte: one total order for every process, the sender's
own frames coming back as ``OWN``, the read barrier's head, the state for a joining process
from a sibling, a process that falls behind the bytes kept told to resync, oversized frames
refused and counted, a process ending in the middle of a frame."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kv_slot_tracker.replication.local import framing as f
from kv_slot_tracker.replication.local.hub import Hub

WAIT_S = 5.0


class Client:
    """One process's side of the socket, frames in and out."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.frames = f.FrameReader()
        self.got: list[bytes] = []

    @classmethod
    async def hello(cls, hub: Hub, instance_id: int, incarnation: int) -> Client:
        client = cls(*await asyncio.open_unix_connection(hub.path))
        client.send(f.frame_u64(f.HELLO, instance_id, incarnation))
        return client

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    def publish(self, last_seq: int, records: bytes, applied: int = 0) -> None:
        self.send(f.frame_u64(f.PUBLISH, last_seq, applied, tail=records))

    async def next(self) -> bytes:
        while not self.got:
            data = await asyncio.wait_for(self.reader.read(65536), WAIT_S)
            assert data, "the hub closed the connection"
            self.got += self.frames.feed(data)
        return self.got.pop(0)

    async def expect(self, kind: bytes) -> bytes:
        frame = await self.next()
        assert frame[:1] == kind, frame[:40]
        return frame

    async def close(self) -> None:
        self.writer.close()
        with pytest.raises(Exception):  # noqa: B017, PT011 - whichever the platform says
            await self.writer.wait_closed()
            raise ConnectionError


async def until(check, what: str) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(WAIT_S / 0.01)):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not reached: {what}")


@pytest.fixture
async def hub(tmp_path: Path) -> AsyncIterator[Hub]:
    h = Hub(tmp_path / "hub.sock", max_frame_bytes=4096, join_wait_s=0.5)
    await h.start()
    try:
        yield h
    finally:
        await h.stop()


def data(frame: bytes) -> tuple[int, bytes]:
    return f.U64.unpack_from(frame, 1)[0], frame[9:]


async def test_one_order_for_everyone_and_own_frames_come_back_short(hub: Hub) -> None:
    a, b = await Client.hello(hub, 1, 11), await Client.hello(hub, 2, 22)
    for c in (a, b):  # nothing was ever sequenced: the empty state at position 0
        assert await c.expect(f.BEGIN) == f.BEGIN + f.U64.pack(0)
    a.publish(3, b"a1")
    b.publish(1, b"b1")
    a.publish(5, b"a2")
    await until(lambda: hub.head == 3, "three frames sequenced")
    seen = {}
    for client, own in ((a, 11), (b, 22)):
        order = []
        for _ in range(3):
            frame = await client.next()
            if frame[:1] == f.OWN:
                order.append(("own", *f.U64_2.unpack_from(frame, 1)))
            else:
                assert frame[:1] == f.DATA
                order.append(("data", *data(frame)))
        seen[own] = order
    # the hub's order is whatever it read first; both see that same order
    a_pos = {e[1]: e for e in seen[11]}
    b_pos = {e[1]: e for e in seen[22]}
    assert sorted(a_pos) == sorted(b_pos) == [1, 2, 3]
    for p in (1, 2, 3):  # at each position: the sender's OWN (its last seq), the other's DATA
        ea, eb = a_pos[p], b_pos[p]
        if ea[0] == "own":
            assert eb[0] == "data" and eb[2] in (b"a1", b"a2")
            assert ea[2] == (3 if eb[2] == b"a1" else 5)
        else:
            assert eb[0] == "own" and eb[2] == 1 and ea[2] == b"b1"
    assert [a_pos[p][2] for p in (1, 2, 3) if a_pos[p][0] == "own"] == [3, 5]  # a's in its order
    assert hub.counters.frames == 3
    await a.close()
    await b.close()


async def test_the_read_barrier_gets_the_head(hub: Hub) -> None:
    a = await Client.hello(hub, 1, 11)
    await a.expect(f.BEGIN)
    a.publish(1, b"r")
    a.publish(2, b"r")
    a.send(f.frame_u64(f.HEAD_ASK, 77))
    kinds = [await a.next() for _ in range(3)]
    heads = [fr for fr in kinds if fr[:1] == f.HEAD]
    assert heads == [f.HEAD + f.U64_2.pack(77, 2)]
    await a.close()


async def test_the_read_barrier_waits_for_what_every_sibling_accepted(hub: Hub) -> None:
    """``HEAD?`` is answered once every other process has sent what it held (``FLUSH``, then
    its frames, then ``FLUSHED``), with a head that counts those frames; a sibling that ends
    instead of answering is not waited for."""
    a, b, c = [await Client.hello(hub, i, i * 11) for i in (1, 2, 3)]
    for client in (a, b, c):
        await client.expect(f.BEGIN)
    a.send(f.frame_u64(f.HEAD_ASK, 5))
    flush_b, flush_c = await b.expect(f.FLUSH), await c.expect(f.FLUSH)
    assert flush_b == flush_c  # one barrier, one token for its siblings
    (token,) = f.U64.unpack_from(flush_b, 1)
    b.publish(1, b"held by b")  # what b had accepted, before its answer
    b.send(f.frame_u64(f.FLUSHED, token))
    await until(lambda: hub.head == 1, "b's frame sequenced")
    await asyncio.sleep(0.05)
    assert a.got == [] and hub.counters.barriers == 0  # c has not answered yet
    await c.close()  # what c had not sent is gone with it: not waited for
    assert await a.expect(f.DATA) == f.DATA + f.U64.pack(1) + b"held by b"
    assert await a.expect(f.HEAD) == f.HEAD + f.U64_2.pack(5, 1)
    assert hub.counters.barriers == 1 and hub.counters.barriers_dropped == 0
    # alone, a process gets the head at once
    await b.close()
    a.send(f.frame_u64(f.HEAD_ASK, 6))
    assert await a.expect(f.HEAD) == f.HEAD + f.U64_2.pack(6, 1)
    await a.close()


async def test_a_joining_process_gets_a_siblings_state_then_the_frames_after_it(hub: Hub) -> None:
    a, b = await Client.hello(hub, 1, 11), await Client.hello(hub, 2, 22)
    await a.expect(f.BEGIN)
    await b.expect(f.BEGIN)
    a.publish(1, b"one")
    await b.expect(f.DATA)
    await a.expect(f.OWN)
    # both applied position 1: the hub forgets it
    a.send(f.frame_u64(f.APPLIED, 1))
    b.send(f.frame_u64(f.APPLIED, 1))
    await until(lambda: hub.retained.first == 2, "position 1 forgotten")
    await b.close()  # b is gone; a new b joins
    b2 = await Client.hello(hub, 2, 23)
    export = await a.expect(f.EXPORT)
    (token,) = f.U64.unpack_from(export, 1)
    a.publish(2, b"two")  # sequenced while the state is on its way: position 2
    await a.expect(f.OWN)
    a.send(f.frame_u64(f.STATE, token, 1, tail=b"state-at-1"))
    assert await b2.expect(f.BEGIN) == f.BEGIN + f.U64.pack(1) + b"state-at-1"
    assert data(await b2.expect(f.DATA)) == (2, b"two")
    assert hub.counters.exports == 1 and hub.counters.joins == 3
    await a.close()
    await b2.close()


async def test_a_large_state_travels_in_pieces_each_under_the_frame_limit(
    hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A state larger than a frame may be (the fixture's hub: 4,096 bytes) goes from the
    exporter in ``STATE+`` pieces and to the joining process in ``BEGIN+`` pieces, whole."""
    monkeypatch.setattr(f, "STATE_PIECE_BYTES", 1000)
    state = bytes(range(256)) * 40  # 10,240 bytes: 11 pieces
    a, b = await Client.hello(hub, 1, 11), await Client.hello(hub, 2, 22)
    await a.expect(f.BEGIN)
    await b.expect(f.BEGIN)
    a.publish(1, b"one")
    await b.expect(f.DATA)
    await a.expect(f.OWN)
    a.send(f.frame_u64(f.APPLIED, 1))
    b.send(f.frame_u64(f.APPLIED, 1))
    await until(lambda: hub.retained.first == 2, "position 1 forgotten")
    b2 = await Client.hello(hub, 2, 23)
    (token,) = f.U64.unpack_from(await a.expect(f.EXPORT), 1)
    frames = f.state_frames(f.STATE_PART, f.STATE, state, (token,), (token, 1))
    assert [len(fr) for fr in frames] == [4 + 1 + 8 + 1000] * 10 + [4 + 1 + 16 + 240]
    for fr in frames:
        a.send(fr)
    got = b""
    while (frame := await b2.next())[:1] == f.BEGIN_PART:
        got += frame[1:]
    assert frame[:1] == f.BEGIN and f.U64.unpack_from(frame, 1) == (1,)
    assert got + frame[9:] == state
    assert hub.counters.oversized == 0 and hub.counters.joins == 3
    await a.close()
    await b.close()
    await b2.close()


async def test_the_exporter_ending_hands_the_join_to_another_sibling(hub: Hub) -> None:
    a, b = await Client.hello(hub, 1, 11), await Client.hello(hub, 2, 22)
    for c in (a, b):
        await c.expect(f.BEGIN)
    a.publish(1, b"one")
    for c in (a, b):
        await c.next()
        c.send(f.frame_u64(f.APPLIED, 1))
    await until(lambda: hub.retained.first == 2, "position 1 forgotten")
    newcomer = await Client.hello(hub, 3, 33)
    asked = await asyncio.wait_for(_first_export(a, b), WAIT_S)
    other = b if asked is a else a
    await asked.close()  # ends without answering
    (token,) = f.U64.unpack_from(await other.expect(f.EXPORT), 1)
    other.send(f.frame_u64(f.STATE, token, 1, tail=b"s"))
    assert await newcomer.expect(f.BEGIN) == f.BEGIN + f.U64.pack(1) + b"s"
    await other.close()
    await newcomer.close()


async def _first_export(a: Client, b: Client) -> Client:
    tasks = {asyncio.ensure_future(c.expect(f.EXPORT)): c for c in (a, b)}
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for t in pending:
        t.cancel()
    return tasks[done.pop()]


async def test_oversized_frames_are_refused_and_counted(hub: Hub) -> None:
    a, b = await Client.hello(hub, 1, 11), await Client.hello(hub, 2, 22)
    await a.expect(f.BEGIN)
    await b.expect(f.BEGIN)
    a.publish(1, b"x" * 5000)  # over the 4096-byte limit: refused
    a.publish(2, b"fits")
    assert data(await b.expect(f.DATA)) == (1, b"fits")
    assert hub.counters.oversized == 1 and hub.head == 1
    await a.close()
    await b.close()


async def test_a_process_ending_mid_frame_loses_only_that_frame(hub: Hub) -> None:
    a, b = await Client.hello(hub, 1, 11), await Client.hello(hub, 2, 22)
    await a.expect(f.BEGIN)
    await b.expect(f.BEGIN)
    a.publish(1, b"whole")
    half = f.frame_u64(f.PUBLISH, 2, 0, tail=b"never complete")
    a.send(half[: len(half) // 2])
    await a.writer.drain()
    assert data(await b.expect(f.DATA)) == (1, b"whole")
    await a.close()
    await until(lambda: hub.counters.cut == 1, "the cut frame counted")
    assert hub.head == 1 and len(hub.connections) == 1
    b.publish(1, b"b goes on")
    assert (await b.expect(f.OWN)) == f.OWN + f.U64_2.pack(2, 1)
    await b.close()


async def test_a_bad_frame_drops_only_its_connection(hub: Hub) -> None:
    a, b = await Client.hello(hub, 1, 11), await Client.hello(hub, 2, 22)
    await a.expect(f.BEGIN)
    await b.expect(f.BEGIN)
    a.send(f.frame(b"?", b"what"))
    assert await a.reader.read(100) == b""  # closed by the hub
    assert hub.counters.refused == 1
    b.publish(1, b"fine")
    await b.expect(f.OWN)
    await b.close()


async def test_a_process_behind_the_bytes_kept_is_told_to_resync(tmp_path: Path) -> None:
    hub = Hub(tmp_path / "small.sock", max_retained_bytes=64 * 1024, join_wait_s=0.5)
    await hub.start()
    try:
        a, b = await Client.hello(hub, 1, 11), await Client.hello(hub, 2, 22)
        await a.expect(f.BEGIN)
        await b.expect(f.BEGIN)
        # b reads nothing: its socket and then its buffer in the hub fill; a keeps up
        chunk = b"z" * 16 * 1024
        seq, token = 0, None
        for _ in range(2000):  # at most ~32 MB: more than the socket plus the hub's 4 MB
            seq += 1
            a.publish(seq, chunk, applied=hub.head)
            await a.writer.drain()
            frame = await a.next()
            if frame[:1] == f.EXPORT:  # a is asked for its state for b
                (token,) = f.U64.unpack_from(frame, 1)
                await a.expect(f.OWN)
                break
            assert frame[:1] == f.OWN
        assert hub.counters.resyncs == 1 and token is not None
        assert hub.retained.bytes <= 64 * 1024 + len(chunk) + 64
        # b, reading again, finds the frames it was sent, RESYNC, then the state
        a.send(f.frame_u64(f.STATE, token, hub.head, tail=b"fresh"))
        while (frame := await b.next())[:1] == f.DATA:
            pass
        assert frame[:1] == f.RESYNC
        assert await b.expect(f.BEGIN) == f.BEGIN + f.U64.pack(hub.head) + b"fresh"
        a.publish(seq + 1, b"after")
        assert data(await b.expect(f.DATA)) == (hub.head, b"after")
        await a.close()
        await b.close()
    finally:
        await hub.stop()


async def test_a_sibling_that_does_not_answer_for_its_state_is_passed_over(
    tmp_path: Path,
) -> None:
    hub = Hub(tmp_path / "slow.sock", export_timeout_s=0.3)
    await hub.start()
    try:
        a, b = await Client.hello(hub, 1, 11), await Client.hello(hub, 2, 22)
        for c in (a, b):
            await c.expect(f.BEGIN)
        a.publish(1, b"one")
        for c in (a, b):
            await c.next()
            c.send(f.frame_u64(f.APPLIED, 1))
        await until(lambda: hub.retained.first == 2, "position 1 forgotten")
        newcomer = await Client.hello(hub, 3, 33)
        asked = await asyncio.wait_for(_first_export(a, b), WAIT_S)  # and says nothing
        other = b if asked is a else a
        (token,) = f.U64.unpack_from(await other.expect(f.EXPORT), 1)
        other.send(f.frame_u64(f.STATE, token, 1, tail=b"s"))
        assert await newcomer.expect(f.BEGIN) == f.BEGIN + f.U64.pack(1) + b"s"
        assert hub.counters.exports == 2
        for c in (a, b, newcomer):
            await c.close()
    finally:
        await hub.stop()


async def test_the_hubs_own_snapshot_restarts_processes_that_all_ended(tmp_path: Path) -> None:
    hub = Hub(tmp_path / "snap.sock", snapshot_every_s=0.1, join_wait_s=30)
    await hub.start()
    try:
        a = await Client.hello(hub, 1, 11)
        await a.expect(f.BEGIN)
        a.publish(1, b"one")
        assert await a.expect(f.OWN) == f.OWN + f.U64_2.pack(1, 1)
        (token,) = f.U64.unpack_from(await a.expect(f.EXPORT), 1)  # the hub asks for itself
        a.send(f.frame_u64(f.STATE, token, 1, tail=b"state-at-1"))
        a.publish(2, b"two", applied=1)
        while (frame := await a.next())[:1] == f.EXPORT:  # the next ask: left unanswered
            pass
        assert frame == f.OWN + f.U64_2.pack(2, 2)
        a.send(f.frame_u64(f.APPLIED, 2))
        await until(lambda: hub.snapshot == (1, b"state-at-1"), "the snapshot kept")
        assert hub.retained.first == 2  # the frames after the snapshot are kept, not before
        await a.close()
        # a second process starts with no process left: the snapshot, then the frame after it
        await until(lambda: not hub.connections, "a gone")
        b = await Client.hello(hub, 2, 22)
        assert await b.expect(f.BEGIN) == f.BEGIN + f.U64.pack(1) + b"state-at-1"
        assert data(await b.expect(f.DATA)) == (2, b"two")
        stats = hub.stats()
        assert stats["snapshots"] >= 1 and stats["snapshot_joins"] == 1
        assert stats["snapshot_position"] == 1 and stats["lost_joins"] == 0
        await b.close()
    finally:
        await hub.stop()
