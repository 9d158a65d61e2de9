"""The read path from the hub: its frames into the local state, in the hub's order.

Everything the hub writes arrives on one connection in order and is handled as it arrives
(``on_frames``, once per read): siblings' records (``DATA``) go to the target's
``apply_remote`` in one batch per read, each checked against the ledger of sequence numbers
(``records.SeqLedger``: a record already applied, e.g. one a sibling re-sent after a
reconnect or one in a loaded state, is a duplicate and skipped); this process's own frames
(``OWN``) mark in the batch how far its own records were read back (``OwnReadBack``, as the
Redis reader does) and release their acknowledgements.

The state. The first frame the hub sends is a state (``BEGIN``, position p: a sibling's
export, or the empty state when the hub still holds every frame); the frames after p follow.
Until it arrives ``ready()`` is False. Own records the loaded state lacks (queued or in flight
when it was loaded, and not in the sibling's ledger) are applied again when the hub sequences
them, in their place in the order (``as_replayed``), as the Redis reader does after a
snapshot. ``EXPORT`` asks this process for its state: it is answered at once, at the position
applied, with the ledger that matches it (own records up to the last one accepted, since the
local state holds them).

The read barrier: ask the hub for its newest position, then wait until the position applied
reaches it. The hub answers once every other process has sent what it accepted (``FLUSH``:
this process writes its outbox, then ``FLUSHED``; before its first state on a connection, when
the outbox does not send yet, right after that state), so a confirmed barrier covers every
change a sibling acknowledged before the call, whatever ``replication_ack``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from itertools import count

import msgpack
import msgspec
from prometheus_client import Histogram

from kv_slot_tracker.core.types import NS_PER_S
from kv_slot_tracker.replication.local import framing
from kv_slot_tracker.replication.local.outbox import LocalOutbox
from kv_slot_tracker.replication.metrics import ReplicationCounters, count_applied
from kv_slot_tracker.replication.port import Batch, OwnReadBack, ReplicatedState
from kv_slot_tracker.replication.records import Delivered, Entry, SeqLedger, as_replayed

log = logging.getLogger(__name__)

_decode_records = msgspec.msgpack.Decoder(list[Entry]).decode  # a frame's records

APPLIED_EVERY_S = 0.05  # how often at most the hub is told the position applied, alone
LEDGER_FORGET_NS = 7 * 24 * 3600 * NS_PER_S


class Phase(enum.Enum):
    """Where the process is; the value is the not-ready reason."""

    CONNECTING = "connecting to the supervisor's hub"
    LOADING = "loading the state from a sibling process"
    READY = ""


class Follower:
    def __init__(
        self,
        instance_id: int,
        incarnation: int,
        counters: ReplicationCounters,
        outbox: LocalOutbox,
        lag: Histogram,
        wall_clock: Callable[[], int],
    ) -> None:
        self.instance_id = instance_id
        self.own_key = (instance_id, incarnation)
        self.counters = counters
        self.outbox = outbox
        self.lag = lag
        self.wall_clock = wall_clock
        self.target: ReplicatedState | None = None
        self.phase = Phase.CONNECTING
        self.loaded = asyncio.Event()
        self.position = 0  # the hub position up to which the local state has applied
        self.last_lag_ms: float | None = None
        self.malformed = 0
        self.hub_stats: dict[str, int] | None = None  # the hub's latest figures
        self._seqs = SeqLedger()
        self._floor = 1  # own records from this seq on are in the local state already
        self._own_through = 0  # own records up to here are in the loaded state
        self._write: Callable[[bytes], None] | None = None
        self._tokens = count(1)
        self._heads: dict[int, asyncio.Future[int]] = {}  # barriers asked, by token
        self._next_head: asyncio.Future[int] | None = None  # the barrier to ask once one returns
        self._waits: list[tuple[int, asyncio.Future[None]]] = []
        self._told = 0  # the position last told to the hub
        self._tell: asyncio.TimerHandle | None = None
        self._flushes: list[int] = []  # FLUSH tokens to answer once the outbox sends
        self._pieces: list[memoryview] = []  # of a state whose BEGIN is still to come

    def ready(self) -> bool:
        return self.phase is Phase.READY

    # -- the connection -----------------------------------------------------------------------

    def connected(self, write: Callable[[bytes], None]) -> None:
        """A new connection to the hub; a state comes first, whatever was loaded before."""
        self._write = write
        if self.phase is Phase.CONNECTING:
            self.phase = Phase.LOADING

    def disconnected(self) -> None:
        self._write = None
        self._flushes.clear()  # the hub forgets what it asked this connection
        self._pieces = []
        for fut in [*self._heads.values(), self._next_head]:
            if fut is not None and not fut.done():
                fut.cancel()
        self._heads.clear()
        self._next_head = None

    # -- frames -------------------------------------------------------------------------------

    def on_frames(self, frames: list[bytes]) -> None:
        batch: Batch = []
        position = self.position
        for frame in frames:
            kind = frame[:1]
            if kind == framing.DATA:
                (position,) = framing.U64.unpack_from(frame, 1)
                self._records(frame, batch)
            elif kind == framing.OWN:
                position, last_seq = framing.U64_2.unpack_from(frame, 1)
                self._own(last_seq, batch)
            elif kind == framing.HEAD:
                token, head = framing.U64_2.unpack_from(frame, 1)
                fut = self._heads.pop(token, None)
                if fut is not None and not fut.done():
                    fut.set_result(head)
                if self._next_head is not None:
                    self._ask_head()
            elif kind == framing.FLUSH:
                (token,) = framing.U64.unpack_from(frame, 1)
                self._flush(token)
            elif kind == framing.EXPORT:
                self._apply(batch, position)
                batch = []
                (token,) = framing.U64.unpack_from(frame, 1)
                self._export(token)
            elif kind == framing.BEGIN_PART:
                self._pieces.append(memoryview(frame)[1:])
            elif kind == framing.BEGIN:
                self._apply(batch, position)
                batch = []
                (position,) = framing.U64.unpack_from(frame, 1)
                state = memoryview(frame)[9:]
                if self._pieces:
                    self._pieces.append(state)
                    state = memoryview(b"".join(self._pieces))
                    self._pieces = []
                self._restore(position, state)
            elif kind == framing.STATS:
                self._hub_stats(frame)
            elif kind == framing.RESYNC:
                self._apply(batch, position)
                batch = []
                self.counters.resets += 1
                log.warning(
                    "fell behind the frames the supervisor's hub keeps; loading its state again"
                )
            else:
                self.malformed += 1
        self._apply(batch, position)

    def _records(self, frame: bytes, batch: Batch) -> None:
        try:
            entries = _decode_records(memoryview(frame)[9:])
        except msgspec.MsgspecError as e:
            self._malformed(f"undecodable frame: {e}")
            return
        seqs, now, own_id = self._seqs, self.wall_clock(), self.instance_id
        for entry in entries:
            record = Delivered(entry.origin, entry.incarnation, entry.seq, entry.ts, entry.record)
            key = (record.origin, record.incarnation)
            seq = record.seq
            missing = seqs.missing_before(key, seq)
            if missing < 0:
                self.counters.duplicates += 1
                continue
            if missing > 0:
                self.counters.gaps += 1
                log.error("%d record(s) of instance %d before seq %d never came; going on",
                          missing, key[0], seq)  # fmt: skip
            seqs.advance(key, seq, now)
            if record.origin == own_id:  # a previous life of this process
                record = as_replayed(record)
            batch.append(record)

    def _own(self, last_seq: int, batch: Batch) -> None:
        """Own records up to ``last_seq`` were sequenced here in the order."""
        done = self.outbox.sequenced(last_seq)
        self.counters.own_skipped += len(done)
        batch.append(OwnReadBack(last_seq))
        floor, through = self._floor, self._own_through
        for e in done:  # those the loaded state lacks, in their place in the order
            if through < e.seq < floor:
                batch.append(
                    Delivered(e.origin, e.incarnation, e.seq, e.ts, e.record, replayed=True)
                )

    def _flush(self, token: int) -> None:
        """A sibling's read barrier: send what the outbox holds, then say so."""
        if self.outbox.write is None:  # not sending on this connection yet: after the state
            self._flushes.append(token)
            return
        self.outbox.flush()
        if self._write is not None:
            self._write(framing.frame_u64(framing.FLUSHED, token))

    def _hub_stats(self, frame: bytes) -> None:
        try:
            stats = msgpack.unpackb(memoryview(frame)[1:], raw=False)
        except Exception:  # noqa: BLE001 - msgpack raises several unrelated types
            stats = None
        if isinstance(stats, dict) and all(type(v) is int for v in stats.values()):
            self.hub_stats = stats
        else:
            self.malformed += 1

    def _malformed(self, why: str) -> None:
        self.malformed += 1
        self.counters.malformed += 1
        self.counters.last_malformed_ns = self.wall_clock()
        log.warning("skipping replica data from the supervisor's hub: %s", why)

    def _apply(self, batch: Batch, position: int) -> None:
        if batch and self.target is not None:
            self.target.apply_remote(batch)
            lag_ms = count_applied(batch, self.wall_clock(), self.counters, self.lag.observe)
            if lag_ms is not None:
                self.last_lag_ms = lag_ms
        if position != self.position:
            self.position = position
            self._advanced()

    def _advanced(self) -> None:
        position = self.position
        if self._waits:
            keep = []
            for target, fut in self._waits:
                if target <= position:
                    if not fut.done():
                        fut.set_result(None)
                elif not fut.done():
                    keep.append((target, fut))
            self._waits = keep
        if self._tell is None and position > self._told and self._write is not None:
            self._tell = asyncio.get_running_loop().call_later(APPLIED_EVERY_S, self._tell_applied)

    def _tell_applied(self) -> None:
        """Tell the hub what is applied here (unless a ``PUBLISH`` said so meanwhile), so it
        can forget the frames every process has."""
        self._tell = None
        if self._write is not None and self.position > self._told:
            self._told = self.position
            self._write(framing.frame_u64(framing.APPLIED, self.position))

    def applied_for_publish(self) -> int:
        """The position a ``PUBLISH`` frame carries (and the hub now knows)."""
        self._told = self.position
        return self.position

    # -- the state ----------------------------------------------------------------------------

    def _export(self, token: int) -> None:
        assert self.target is not None
        seqs = self._seqs.copy()
        seqs.prune(self.wall_clock() - LEDGER_FORGET_NS)
        own = self.outbox.last_accepted_seq
        if own > seqs.get(self.own_key):
            seqs.advance(self.own_key, own, self.wall_clock())
        state = msgpack.packb(
            {
                "trackers": self.target.export_state(),
                "early": self.target.export_early(),
                "selection": self.target.export_selection(),
                "seqs": seqs.export(),
            }
        )
        if self._write is not None:
            for frame in framing.state_frames(
                framing.STATE_PART, framing.STATE, state, (token,), (token, self.position)
            ):
                self._write(frame)

    def _restore(self, position: int, blob: memoryview) -> None:
        assert self.target is not None
        if blob:
            state = msgpack.unpackb(blob, raw=False)
            self.target.restore_state(state["trackers"], state["early"], state["selection"])
            self._seqs = SeqLedger.load(state["seqs"])
        else:  # the empty state, before the hub's first frame
            self.target.restore_state([], [], None)
            self._seqs = SeqLedger()
        self._own_through = self._seqs.get(self.own_key)
        self.outbox.sequenced(self._own_through)  # in the state: sequenced before ``position``
        self._floor = self.outbox.next_seq
        self.counters.bootstraps += 1
        self.position = position
        self._advanced()
        first = self.phase is not Phase.READY
        self.phase = Phase.READY
        self.loaded.set()
        if self._write is not None and self.outbox.write is None:  # first state on this connection
            self.outbox.connected(self._write)
            flushes, self._flushes = self._flushes, []
            for token in flushes:
                self._flush(token)
        log.log(logging.INFO if first else logging.WARNING,
                "loaded the state at position %d of the supervisor's hub (%d bytes)",
                position, len(blob))  # fmt: skip

    # -- the read barrier ---------------------------------------------------------------------

    async def caught_up(self, timeout_s: float) -> bool:
        """True once every frame the hub had sequenced when called is applied here; False
        when that could not be established within ``timeout_s``.

        Barriers are shared: at most one ``HEAD?`` is in flight, and the calls arriving
        meanwhile share the next one, asked when it returns (so after they arrived). Each costs
        every sibling a flush, so under load this bounds them to one per round trip."""
        if self._write is None or timeout_s <= 0 or not self.ready():
            return False
        head_fut = self._next_head
        if head_fut is None:
            head_fut = self._next_head = asyncio.get_running_loop().create_future()
            if not self._heads:
                self._ask_head()
        try:
            async with asyncio.timeout(timeout_s):
                head = await asyncio.shield(head_fut)  # shared: a timeout here cancels no other
                if head <= self.position:
                    return True
                fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                self._waits.append((head, fut))
                await fut
                return True
        except (TimeoutError, asyncio.CancelledError):
            if asyncio.current_task() is not None and asyncio.current_task().cancelling():  # type: ignore[union-attr]
                raise
            return False

    def _ask_head(self) -> None:
        """Ask the hub for the barrier the waiting calls share."""
        fut, self._next_head = self._next_head, None
        if fut is None or self._write is None:
            return
        token = next(self._tokens)
        self._heads[token] = fut
        self._write(framing.frame_u64(framing.HEAD_ASK, token))
