"""Replica wire format and in-process cross-instance sync (SPEC §6.2, §6.6, §9.5 Q07/Q08).

Ports of the [seed-RT] (``shared/seeds/001_7a71462dbe079ad1.txt``) wire and runtime tests. The
runtime's event plane is replaced by an in-process pub/sub ``Bus``: each replica's tracker enqueues
into its bounded publish queue, a publisher task encodes events as singleton (NATS) or batch (ZMQ)
frames onto the bus, and every replica subscribed to that bus decodes them and runs
``run_replica_sync``. Different buses stand for different endpoints.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable

import msgpack
import msgspec
import pytest

from kv_slot_tracker.core.events import (
    FREE,
    MARK_PREFILL_COMPLETED,
    ActiveSequenceEvent,
    AddRequest,
    EventDecodeError,
    duration_to_wire,
    event_from_wire,
    event_to_wire,
)
from kv_slot_tracker.core.tracker import SequencePublisher
from kv_slot_tracker.core.types import PrefillLoadHint, WorkerWithDpRank
from kv_slot_tracker.replication.queue import EventQueue
from kv_slot_tracker.service import records as r
from tests.fakes import FakeClock
from tests.support.recording import tracking_hint
from tests.support.replica_runtime import (
    PENDING,
    Cancel,
    collect_batch,
    run_singleton_publisher,
    send_event,
    start_replica_sync,
)
from tests.support.tracker import (
    SequenceRequest,
    active_request_counts,
    add_request,
    assert_completely_drained,
    new_tracker,
    request_ranks,
)
from tests.support.wire import decode_batch, decode_event, encode_batch, encode_event

# -- Q07 --------------------------------------------------------------------------------------


def free_event(request_id: str) -> ActiveSequenceEvent:
    return ActiveSequenceEvent(request_id, WorkerWithDpRank(1, 0), FREE, 7, None)


def test_active_sequence_wire_format_uses_singletons_only_for_nats() -> None:
    # Port intent: a singleton (NATS) payload is one event and never a batch; a batch (ZMQ)
    # payload is a batch and never one event.
    event = free_event("request")

    singleton_payload = encode_event(event)
    decoded = decode_event(singleton_payload)
    assert decoded.request_id == "request"
    assert decoded == event
    with pytest.raises(EventDecodeError):
        decode_batch(singleton_payload)

    batch_payload = encode_batch([event])
    decoded_batch = decode_batch(batch_payload)
    assert decoded_batch[0].request_id == "request"
    assert decoded_batch == [event]
    with pytest.raises(EventDecodeError):
        decode_event(batch_payload)


# -- Q08: Appendix B frames ------------------------------------------------------------------

ROUTER_ID = 13337346312156717402
Q1_WORKER = WorkerWithDpRank(1, 0)

# Payload frames exactly as captured in SPEC Appendix B (bytes.fromhex skips the line breaks).
ADD_FRAME = """
84aa6d6f64656c5f6e616d65a2726dad726f7574696e675f67726f7570a764656661756c74aa626c6f636b5f73697a6504
a56576656e7485aa726571756573745f6964a27131a6776f726b657282a9776f726b65725f696401a764705f72616e6b00
a46461746181aa4164645265717565737484ae746f6b656e5f73657175656e63659301cffffffffffffffffe03b4747261
636b5f70726566696c6c5f746f6b656e73c3b665787065637465645f6f75747075745f746f6b656e73c0b170726566696c
6c5f6c6f61645f68696e7482d920696e697469616c5f6566666563746976655f70726566696c6c5f746f6b656e730cb965
787065637465645f70726566696c6c5f6475726174696f6ec0a9726f757465725f6964cfb917c5ce7e77a15aa96c6f7261
5f6e616d65c0
"""
MARK_FRAME = """
84aa6d6f64656c5f6e616d65a2726dad726f7574696e675f67726f7570a764656661756c74aa626c6f636b5f73697a6504
a56576656e7485aa726571756573745f6964a27131a6776f726b657282a9776f726b65725f696401a764705f72616e6b00
a464617461b44d61726b50726566696c6c436f6d706c65746564a9726f757465725f6964cfb917c5ce7e77a15aa96c6f72
615f6e616d65c0
"""
FREE_FRAME = """
84aa6d6f64656c5f6e616d65a2726dad726f7574696e675f67726f7570a764656661756c74aa626c6f636b5f73697a6504
a56576656e7485aa726571756573745f6964a27131a6776f726b657282a9776f726b65725f696401a764705f72616e6b00
a464617461a446726565a9726f757465725f6964cfb917c5ce7e77a15aa96c6f72615f6e616d65c0
"""

APPENDIX_B = [
    pytest.param(
        ADD_FRAME,
        ActiveSequenceEvent(
            "q1",
            Q1_WORKER,
            # the frame carries 2**64 - 2 (u64); the service keeps it signed
            AddRequest([1, -2, 3], True, None, PrefillLoadHint(12, None)),
            ROUTER_ID,
            None,
        ),
        id="add",
    ),
    pytest.param(
        MARK_FRAME,
        ActiveSequenceEvent("q1", Q1_WORKER, MARK_PREFILL_COMPLETED, ROUTER_ID, None),
        id="mark",
    ),
    pytest.param(
        FREE_FRAME, ActiveSequenceEvent("q1", Q1_WORKER, FREE, ROUTER_ID, None), id="free"
    ),
]


@pytest.mark.parametrize(("frame_hex", "event"), APPENDIX_B)
def test_appendix_b_frames_reencode_byte_for_byte(
    frame_hex: str, event: ActiveSequenceEvent
) -> None:
    """The frames are records of stream format 1 (without the envelope's fields): read as
    such, and this version's record of the same event is the same map behind its kind tag."""
    frame = bytes.fromhex(frame_hex)
    record = r.decode(frame, 1)
    assert record == r.EventRecord("rm", "default", 4, event_to_wire(event))
    assert event_from_wire(record.event) == event  # type: ignore[union-attr]
    assert r.encode(record) == b"\x85\xa1k\xa5event" + frame[1:]  # a map of 5: the tag first


def test_appendix_b_event_field_order_and_duration_encoding() -> None:
    wire = event_to_wire(
        ActiveSequenceEvent("q1", Q1_WORKER, AddRequest([], False, None, None), ROUTER_ID)
    )
    add = msgpack.unpackb(msgspec.msgpack.encode(wire))
    assert list(add) == ["request_id", "worker", "data", "router_id", "lora_name"]
    assert add["data"] == {
        "AddRequest": {
            "token_sequence": [],
            "track_prefill_tokens": False,
            "expected_output_tokens": None,
            "prefill_load_hint": None,
        }
    }
    assert msgspec.msgpack.encode(duration_to_wire(10 * 1_000_000_000)) == bytes.fromhex(
        "82a4736563730aa56e616e6f7300"
    )


# -- in-process event plane -------------------------------------------------------------------

Decoder = Callable[[bytes], list[ActiveSequenceEvent]]
WIRE_DECODERS: dict[str, Decoder] = {
    "singleton": lambda frame: [decode_event(frame)],
    "batch": decode_batch,
}


class BusSubscriber:
    """The runtime subscriber: decodes frames and yields their events one by one, in order."""

    def __init__(self, decode: Decoder) -> None:
        self.frames: asyncio.Queue[bytes] = asyncio.Queue()
        self._decode = decode
        self._pending: deque[ActiveSequenceEvent] = deque()

    async def next_event(self) -> ActiveSequenceEvent:
        while not self._pending:
            self._pending.extend(self._decode(await self.frames.get()))
        return self._pending.popleft()

    def try_next_event(self) -> object:
        while not self._pending:
            try:
                frame = self.frames.get_nowait()
            except asyncio.QueueEmpty:
                return PENDING
            self._pending.extend(self._decode(frame))
        return self._pending.popleft()


class Bus:
    """One endpoint's replica subject: every published frame reaches every subscriber."""

    def __init__(self, wire: str) -> None:
        self.wire = wire
        self.subscribers: list[BusSubscriber] = []
        self.frames_published = 0

    def subscribe(self) -> BusSubscriber:
        subscriber = BusSubscriber(WIRE_DECODERS[self.wire])
        self.subscribers.append(subscriber)
        return subscriber

    def publish(self, frame: bytes) -> None:
        self.frames_published += 1
        for subscriber in self.subscribers:
            subscriber.frames.put_nowait(frame)


class QueuePublisher(SequencePublisher):
    def __init__(self, queue: EventQueue[ActiveSequenceEvent]) -> None:
        self.queue = queue

    def enqueue_event(self, event: ActiveSequenceEvent) -> None:
        send_event(self.queue, event)


class Replica:
    """A tracker wired to a bus: publish queue -> publisher task -> bus -> replica sync loop."""

    def __init__(
        self,
        bus: Bus,
        router_id: int,
        workers: dict[int, tuple[int, int]],
        clock: FakeClock,
    ) -> None:
        self.bus = bus
        self.queue: EventQueue[ActiveSequenceEvent] = EventQueue()
        self.tracker = new_tracker(
            QueuePublisher(self.queue),
            4,
            workers,
            replica_sync=True,
            router_id=router_id,
            clock=clock.now,
        )
        self.cancel = Cancel()
        self.tasks = [
            start_replica_sync(self.tracker, bus.subscribe(), self.cancel),
            asyncio.create_task(self._publish_loop()),
        ]

    async def _publish_loop(self) -> None:
        bus = self.bus
        if bus.wire == "singleton":

            async def publish(event: ActiveSequenceEvent) -> None:
                bus.publish(encode_event(event))

            await run_singleton_publisher(self.queue, publish)
            return
        while True:
            events, stop = await collect_batch(self.queue)
            if events:
                bus.publish(encode_batch(events))
            if stop:
                return

    async def stop(self) -> None:
        self.cancel.cancel()
        self.queue.shutting_down = True
        self.queue.close()
        done, pending = await asyncio.wait(self.tasks, timeout=2.0)
        for task in pending:
            task.cancel()
        assert not pending, "replica tasks should stop on cancellation / queue close"
        for task in done:
            assert task.exception() is None


@pytest.fixture
async def replicas() -> AsyncIterator[list[Replica]]:
    started: list[Replica] = []
    yield started
    for replica in started:
        await replica.stop()


async def eventually(predicate: Callable[[], bool], timeout_s: float = 2.0) -> None:
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0)

    await asyncio.wait_for(poll(), timeout_s)


WIRES = pytest.mark.parametrize("wire", ["singleton", "batch"])


# -- runtime seed tests -----------------------------------------------------------------------


@WIRES
async def test_active_sequence_replica_sync_isolated_by_endpoint(
    wire: str, replicas: list[Replica]
) -> None:
    clock = FakeClock()
    bus_a, bus_b = Bus(wire), Bus(wire)
    workers = {0: (0, 1)}
    a = Replica(bus_a, 1, workers, clock)
    a_peer = Replica(bus_a, 3, workers, clock)
    b = Replica(bus_b, 2, workers, clock)
    replicas.extend([a, a_peer, b])
    worker = WorkerWithDpRank(0, 0)

    add_request(
        a.tracker,
        SequenceRequest(
            "endpoint-a-request-0", worker, [1, 2, 3, 4], prefill_load_hint=tracking_hint(4)
        ),
        clock.now(),
    )
    await eventually(lambda: a_peer.tracker.active_blocks()[worker] > 0)

    assert a.tracker.active_blocks()[worker] == 4
    assert a_peer.tracker.active_blocks()[worker] == 4
    assert a_peer.tracker.worker_for("endpoint-a-request-0") == worker
    assert bus_a.frames_published == 1
    for _ in range(50):  # give a leak every chance to be applied
        await asyncio.sleep(0)
    assert bus_b.frames_published == 0
    assert all(s.frames.empty() for s in bus_b.subscribers)
    assert b.tracker.active_blocks()[worker] == 0
    assert b.tracker.worker_for("endpoint-a-request-0") is None
    # a's own event came back on its bus and was ignored (echo suppression): still one copy
    assert active_request_counts(a.tracker)[worker] == 1


@WIRES
async def test_multi_worker_cross_instance_sync(wire: str, replicas: list[Replica]) -> None:
    clock = FakeClock()
    bus = Bus(wire)
    workers = {0: (0, 2), 1: (0, 1)}
    r1 = Replica(bus, 1, workers, clock)
    r2 = Replica(bus, 2, workers, clock)
    replicas.extend([r1, r2])
    s1, s2 = r1.tracker, r2.tracker
    w00, w01, w10 = WorkerWithDpRank(0, 0), WorkerWithDpRank(0, 1), WorkerWithDpRank(1, 0)
    decay_now = clock.now()

    add_request(
        s1,
        SequenceRequest("request_0", w00, [0, 1, 2], prefill_load_hint=tracking_hint(12)),
        decay_now,
    )
    add_request(
        s1, SequenceRequest("request_1", w01, [3, 4], prefill_load_hint=tracking_hint(8)), decay_now
    )
    add_request(
        s2,
        SequenceRequest("request_2", w10, [0, 1, 2, 3], prefill_load_hint=tracking_hint(16)),
        decay_now,
    )
    await eventually(
        lambda: (
            s1.worker_for("request_2") == w10
            and s2.worker_for("request_0") == w00
            and s2.worker_for("request_1") == w01
        )
    )

    blocks_phase1 = s1.active_blocks()
    tokens_phase1 = s1.active_tokens(clock.now())
    assert blocks_phase1[w00] == 3
    assert blocks_phase1[w01] == 2
    assert blocks_phase1[w10] == 4
    assert tokens_phase1[w00] == 12
    assert tokens_phase1[w01] == 8
    assert tokens_phase1[w10] == 16
    assert s2.active_blocks() == blocks_phase1  # both replicas share one view
    assert s2.active_tokens(clock.now()) == tokens_phase1

    # each replica frees requests the other one created
    s1.free("request_2", clock.now())
    s2.free("request_0", clock.now())
    s2.free("request_1", clock.now())
    await eventually(lambda: not request_ranks(s1) and not request_ranks(s2))

    blocks_phase2 = s2.active_blocks()
    tokens_phase2 = s2.active_tokens(clock.now())
    for worker in (w00, w01, w10):
        assert blocks_phase2[worker] == 0, worker
        assert tokens_phase2[worker] == 0, worker
    assert_completely_drained(s1, clock.now())
    assert_completely_drained(s2, clock.now())


@WIRES
async def test_multi_worker_no_token_sequence_sync(wire: str, replicas: list[Replica]) -> None:
    clock = FakeClock()
    bus = Bus(wire)
    workers = {0: (0, 1), 1: (0, 1), 2: (0, 1)}
    r1 = Replica(bus, 1, workers, clock)
    r2 = Replica(bus, 2, workers, clock)
    replicas.extend([r1, r2])
    s1, s2 = r1.tracker, r2.tracker
    w0, w1, w2 = WorkerWithDpRank(0), WorkerWithDpRank(1), WorkerWithDpRank(2)
    decay_now = clock.now()

    add_request(
        s1, SequenceRequest("request_0", w0, None, prefill_load_hint=tracking_hint(12)), decay_now
    )
    add_request(
        s1, SequenceRequest("request_1", w1, None, prefill_load_hint=tracking_hint(8)), decay_now
    )
    add_request(
        s2, SequenceRequest("request_2", w2, None, prefill_load_hint=tracking_hint(16)), decay_now
    )
    await eventually(
        lambda: (
            s1.worker_for("request_2") == w2
            and s2.worker_for("request_0") == w0
            and s2.worker_for("request_1") == w1
        )
    )

    tokens_phase1 = s1.active_tokens(clock.now())
    assert tokens_phase1[w0] == 12
    assert tokens_phase1[w1] == 8
    assert tokens_phase1[w2] == 16
    assert s1.active_blocks() == {w0: 0, w1: 0, w2: 0}

    s1.mark_prefill_completed("request_2", clock.now())
    s1.free("request_2", clock.now())
    s2.mark_prefill_completed("request_0", clock.now())
    s2.mark_prefill_completed("request_1", clock.now())
    s2.free("request_0", clock.now())
    s2.free("request_1", clock.now())
    await eventually(lambda: not request_ranks(s1) and not request_ranks(s2))

    tokens_phase2 = s2.active_tokens(clock.now())
    for worker in (w0, w1, w2):
        assert tokens_phase2[worker] == 0, worker
    assert s1.active_tokens(clock.now()) == {w0: 0, w1: 0, w2: 0}
    assert active_request_counts(s2) == {w0: 0, w1: 0, w2: 0}
