"""The write path to the hub: number each record, batch what was published, keep it until the
hub sequenced it.

``publish`` wraps the record (the service's bytes) in the envelope of the stream's entries, with
``incarnation`` and ``seq`` (dense, as with Redis: ``records``), and queues it without awaiting anything; the first record after a send schedules the next one
(``replication_batch_ms`` later, at once with 0), and everything queued by then goes to the hub
in ``PUBLISH`` frames of at most ``replication_batch_events`` records. A sent frame is kept
(*in flight*) until the hub's ``OWN`` says it was sequenced: that is the acknowledgement
(``appended``) and, after a state load, how records missing from the loaded state are found.
What is queued and in flight is bounded by ``outbox_capacity`` records and
``outbox_max_bytes``; a full outbox drops the newest record (counted), as with Redis.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

import msgspec

from kv_slot_tracker.replication.local import framing
from kv_slot_tracker.replication.metrics import ReplicationCounters
from kv_slot_tracker.replication.queue import Acks, resolve, wait_acknowledged
from kv_slot_tracker.replication.records import Entry, record_bytes
from kv_slot_tracker.settings import Settings

log = logging.getLogger(__name__)

_encode = msgspec.msgpack.Encoder().encode  # a frame's records: a list of ``Entry``


class LocalOutbox:
    def __init__(
        self, settings: Settings, counters: ReplicationCounters, origin: int, incarnation: int
    ) -> None:
        self.counters = counters
        self.origin = origin
        self.incarnation = incarnation
        self.capacity = settings.outbox_capacity
        self.max_bytes = settings.outbox_max_bytes
        self.batch_events = settings.replication_batch_events
        self.batch_s = settings.replication_batch_ms / 1000
        self._queued: list[Entry] = []
        self._in_flight: deque[tuple[int, list[Entry]]] = deque()  # (last seq, records)
        self._in_flight_count = 0
        self.held_bytes = 0  # ``record_bytes`` of the records queued and in flight
        self._next_seq = 1
        self.sequenced_seq = 0  # our records up to here are sequenced by the hub
        self._acks: Acks = deque()
        self._scheduled = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.write: Callable[[bytes], None] | None = None  # set while the hub may be written to
        self.applied: Callable[[], int] = lambda: 0  # the follower's position, sent along
        self.closed = False

    # -- accepting records --------------------------------------------------------------------

    def publish(self, record: bytes, ts: int) -> int:
        seq = self._next_seq
        size = record_bytes(record)
        held = len(self._queued) + self._in_flight_count
        if (
            self.closed
            or held >= self.capacity
            or (self.held_bytes + size > self.max_bytes and held)
        ):
            self.counters.dropped += 1
            if not self.closed:
                log.error("replication outbox full; dropping a record (%d in total)",
                          self.counters.dropped)  # fmt: skip
            return 0
        self._next_seq = seq + 1
        self.held_bytes += size
        self._queued.append(Entry(self.origin, self.incarnation, seq, ts, record))
        if not self._scheduled and self.write is not None and self.loop is not None:
            self._scheduled = True
            if self.batch_s:
                self.loop.call_later(self.batch_s, self.flush)
            else:
                self.loop.call_soon(self.flush)
        return seq

    @property
    def next_seq(self) -> int:
        return self._next_seq

    @property
    def last_accepted_seq(self) -> int:
        return self._next_seq - 1

    def pending(self) -> int:
        """Records not yet sequenced by the hub (queued or in flight)."""
        return len(self._queued) + self._in_flight_count

    # -- sending ------------------------------------------------------------------------------

    def flush(self) -> None:
        """Send everything queued (when the hub may be written to)."""
        self._scheduled = False
        write, queued = self.write, self._queued
        if write is None or not queued:
            return
        self._queued = []
        applied = self.applied()
        frames = []
        for i in range(0, len(queued), self.batch_events):
            records = queued[i : i + self.batch_events]
            last = records[-1].seq
            payload = _encode(records)
            frames.append(framing.frame_u64(framing.PUBLISH, last, applied, tail=payload))
            self._in_flight.append((last, records))
            self._in_flight_count += len(records)
        self.counters.published += len(queued)
        write(b"".join(frames))

    def connected(self, write: Callable[[bytes], None] | None) -> None:
        """The hub may be written to (``write``) or not (None); on connecting, what was in
        flight on a previous connection is sent again (a record the hub sequenced already is
        a duplicate to every reader, skipped by its ledger)."""
        self.write = write
        if write is None:
            return
        if self._in_flight:
            again = [r for _, records in self._in_flight for r in records]
            self._in_flight.clear()
            self._in_flight_count = 0
            self._queued = again + self._queued
            self.counters.resent += len(again)
        self.flush()

    # -- the hub's answers --------------------------------------------------------------------

    def sequenced(self, last_seq: int) -> list[Entry]:
        """The hub sequenced our records up to ``last_seq``: release their acknowledgements;
        returns them (for a replay after a state load)."""
        done: list[Entry] = []
        in_flight = self._in_flight
        while in_flight and in_flight[0][0] <= last_seq:
            _, records = in_flight.popleft()
            self._in_flight_count -= len(records)
            self.held_bytes -= sum(record_bytes(r.record) for r in records)
            done += records
        if last_seq > self.sequenced_seq:
            self.sequenced_seq = last_seq
            keep: Acks = deque()
            for seq, fut in self._acks:
                if seq <= last_seq:
                    resolve(fut, True)
                elif not fut.done():
                    keep.append((seq, fut))
            self._acks = keep
        return done

    async def appended(self, seq: int, timeout_s: float) -> bool:
        """Until our records up to ``seq`` are sequenced by the hub (True), at most
        ``timeout_s`` (False)."""
        if seq <= self.sequenced_seq:
            return True
        return await wait_acknowledged(self._acks, seq, timeout_s)

    def close(self) -> None:
        self.closed = True
        self.flush()
