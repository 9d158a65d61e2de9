"""The ZMQ listener of one worker rank (its SUB socket and replay), and the one connection policy.

The engines' framing (vLLM ``vllm/distributed/kv_events.py`` and SGLang
``srt/disaggregation/kv_events.py``, ``ZmqEventPublisher``): a live message is ``[topic, seq,
payload]`` with ``seq`` 8 bytes big-endian and any topic (the reference subscribes to every
topic, and so does this listener). The replay socket is a ROUTER: a DEALER sends ``[b"", start]``
and gets ``[b"", topic, seq, payload]`` per buffered batch from ``start`` on, then ``[b"", b"",
-1, b""]``. The 3-frame answer ``[b"", seq, payload]`` of older publishers is read too (the frame
count tells them apart).

Connection policy. The SUB socket connects to the rank's ``kv_events_endpoint`` and libzmq
reconnects by itself (``RECONNECT_IVL`` 100 ms, backing off to 5 s) while the publisher is away.
Where libzmq gives the connection up for good (a message over ``kv_events_max_message_bytes`` is
a protocol error: the socket monitor reports the disconnect and no retry follows), the listener
counts it and connects again within ``DROP_GRACE_S``. Like any ZMQ subscriber it only receives
what is published after its connection is established: earlier batches are a gap.

Sequence numbers (as the reference, ``services/indexer/listener.rs``): the first batch should be
0 and each next one the previous plus one; one at or below the last applied is stale (skipped).
A gap (a first batch above 0 included) is asked for from the engine's replay socket
(``replay_endpoint``); each replayed batch is applied like a live one. A gap the replay does not
fill (no replay endpoint, a timeout, a replay that starts late, has holes or stops short) follows
``kv_events_gap_policy``: ``continue`` (the reference's way, the default) keeps the rank's blocks
and applies the next batches; ``clear`` forgets the rank's blocks first.

Where this listener differs from the reference, on purpose:

* a publisher starting again at sequence 0 (an engine restart: its cache is empty) clears the
  rank, whatever the policy, and its batches are applied from there; the reference skips them as
  stale until their numbers pass the old ones and keeps the old blocks, routing on blocks that
  are gone;
* a malformed message never opens a gap: one whose sequence number decodes consumes that number
  (counted, skipped), one whose framing or sequence frame does not decode changes nothing;
* a batch naming a dp rank the worker does not have is rejected (the reference indexes it);
* a sequence number further than ``kv_events_max_seq_jump`` from the last one applied (ahead, or
  behind but not 0) is held back: the next batch decides. Continuing the old numbering drops it;
  continuing from it (``seq + 1``) makes it the stream's numbering (a gap from the old one, or a
  restart when it went back). One bogus number (2^64-1, say) cannot leave the rank stale for good;
* a batch of more than ``kv_events_max_batch_blocks`` block hashes is rejected; a large one is
  decoded off the event loop and applied in slices of ``SLICE_BLOCKS`` blocks
  (``kv_slot_tracker.ingest.slices``; a host or disk store is applied whole), so no batch holds the loop long;
* the replay waits ``kv_events_replay_timeout_seconds`` at most (the reference waits for ever).

Every rejection is counted by kind (``port.WARNING_KINDS``) and logged at most once per
``LOG_INTERVAL_S`` per rank and kind (the count of lines left out follows in the next one).

Memory per rank is bounded by what libzmq may queue (``QUEUE_BYTES``), one message being decoded
(a few times its size) and the index's own bounds.

A listener may start from a watermark handed over by another instance together with the index
it describes (``seed``, peer recovery: ``kv_slot_tracker.ingest.peers``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from .port import IngestCounters, KvEventSink, RankKey, Subscription
from .records import (
    BlocksRemoved,
    BlocksStored,
    KvBatch,
    MalformedMessage,
    decode_batch,
    decode_seq,
)
from .slices import apply_in_slices, batch_blocks

log = logging.getLogger(__name__)

GapPolicy = Literal["continue", "clear"]

RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 5_000
DROP_GRACE_S = 0.5
"""After a disconnect, how long to wait for libzmq's own retry before connecting again."""
QUEUE_BYTES = 256 << 20
"""What libzmq may queue for one rank while the loop is busy: ``QUEUE_BYTES //
kv_events_max_message_bytes`` messages (at least ``MIN_RCVHWM``); the engine's PUB socket keeps
the rest (its ``hwm``, 100,000 messages by default) until the listener reads again."""
MIN_RCVHWM = 8
REPLAY_TIMEOUT_S = 2.0
LOG_INTERVAL_S = 10.0
INLINE_DECODE_BYTES = 64 << 10
"""Payloads up to this size decode on the loop; larger ones in the ingest's decoder thread."""


@dataclass(frozen=True, slots=True)
class ListenerLimits:
    """The settings every listener follows (``kv_events_*``)."""

    max_message_bytes: int = 16 << 20
    max_batch_blocks: int = 16_384
    max_seq_jump: int = 100_000
    gap_policy: GapPolicy = "continue"
    replay_timeout: float = REPLAY_TIMEOUT_S


class RankListener:
    """The SUB socket of one worker rank and its sequence watermark."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        sink: KvEventSink,
        counters: IngestCounters,
        key: RankKey,
        sub: Subscription,
        *,
        limits: ListenerLimits | None = None,
        decoder: ThreadPoolExecutor | None = None,
    ) -> None:
        self.ctx, self.sink, self.counters = ctx, sink, counters
        self.worker_id, self.dp_rank = key
        self.sub = sub
        self.limits = limits or ListenerLimits()
        self.decoder = decoder
        self.watermark: int | None = None
        self.last_message_at: float | None = None
        self.started_at = time.monotonic()
        self.connected = False
        """The SUB socket holds a connection to the publisher (socket monitor events)."""
        self.held: int | None = None
        """A sequence number out of line with the stream, waiting for the next to confirm it."""
        self._replay: zmq.asyncio.Socket | None = None
        self._lost_handled = False
        self._logged: dict[str, tuple[float, int]] = {}  # kind -> (last line, lines left out)

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        s.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        s.setsockopt(zmq.MAXMSGSIZE, self.limits.max_message_bytes)
        s.setsockopt(zmq.RCVHWM, max(MIN_RCVHWM, QUEUE_BYTES // self.limits.max_message_bytes))
        return s

    async def run(self) -> None:
        sock = self._socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
            | zmq.EVENT_CONNECT_DELAYED
        )  # fmt: skip
        watcher = asyncio.create_task(self._watch(sock, monitor))
        try:
            sock.connect(self.sub.endpoint)
            log.info(
                "KV events: listening worker_id=%d dp_rank=%d endpoint=%s",
                self.worker_id, self.dp_rank, self.sub.endpoint,
            )  # fmt: skip
            while True:
                await self.on_message(await sock.recv_multipart())
        finally:  # no await here: a second cancellation must not skip the closing
            watcher.cancel()
            self.connected = False
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)
            self._close_replay()

    async def _watch(self, sock: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> None:
        """Follow the SUB socket's connection; connect again where libzmq gave it up.

        A connection that broke is retried by libzmq, which reports ``CONNECT_RETRIED`` right
        after ``DISCONNECTED``; one it closed for a protocol error (an oversized message) is not,
        and nothing follows: then the endpoint is disconnected and connected afresh."""
        dropped = False
        while True:
            if dropped and not await monitor.poll(int(DROP_GRACE_S * 1000)):
                dropped = False
                self.counters.reconnects += 1
                self.warn("connection_dropped", "the publisher's connection was dropped for good "
                          "(a message over %d bytes?); connecting again",
                          self.limits.max_message_bytes)  # fmt: skip
                with contextlib.suppress(zmq.ZMQError):
                    sock.disconnect(self.sub.endpoint)
                sock.connect(self.sub.endpoint)
                continue
            frames = await monitor.recv_multipart()
            try:
                event = parse_monitor_message(frames)["event"]
            except Exception:  # a monitor message libzmq did not document: not ours to judge
                continue
            if event == zmq.EVENT_CONNECTED:
                self.connected, dropped = True, False
            elif event == zmq.EVENT_DISCONNECTED:
                self.connected, dropped = False, True
                log.info(
                    "KV events: publisher of worker_id=%d dp_rank=%d disconnected",
                    self.worker_id, self.dp_rank,
                )  # fmt: skip
            else:  # libzmq is (re)connecting by itself
                dropped = False

    # -- one live message ------------------------------------------------------------------

    async def on_message(self, frames: list[bytes]) -> None:
        self.last_message_at = time.monotonic()
        self.counters.bytes += sum(map(len, frames))
        if len(frames) != 3:
            self._malformed("malformed_frames", f"expected 3 frames (topic, seq, payload), "
                            f"got {len(frames)}")  # fmt: skip
            return
        try:
            seq = decode_seq(frames[1])
        except MalformedMessage as e:
            self._malformed("malformed_seq", str(e))
            return
        if not self._in_line(seq):
            return
        start = self._gap_start(seq)
        if start is not None:
            await self._fill_gap(start, seq)
        if self.watermark is not None and seq <= self.watermark:
            self.counters.stale += 1
            self.counters.warnings["stale"] += 1
            return
        await self._consume(seq, frames[2])

    def _in_line(self, seq: int) -> bool:
        """Whether ``seq`` may be taken as the stream's; clears the rank on a restart."""
        w = self.watermark
        if w is None:
            self.held = None
            return True
        if seq == 0 and w > 0:
            self._restarted(seq)
            return True
        jump = self.limits.max_seq_jump
        if not (seq > w + jump or w - seq > jump):
            self.held = None
            return True
        if self.held is not None and seq == self.held + 1:
            self.held = None  # the publisher's numbering did move
            if seq < w:
                self._restarted(seq)
            return True
        self.held = seq
        self.warn("seq_out_of_line", "sequence number %d is %d away from the last applied (%d);"
                  " held until the next batch confirms it", seq, abs(seq - w), w)  # fmt: skip
        return False

    def _restarted(self, seq: int) -> None:
        self.counters.restarts += 1
        self.warn("publisher_restart", "the publisher started again (sequence %d after %s);"
                  " clearing the rank", seq, self.watermark)  # fmt: skip
        self.sink.clear_kv_rank(self.worker_id, self.dp_rank)
        self.watermark = None

    def _gap_start(self, seq: int) -> int | None:
        if self.watermark is None:
            return 0 if seq > 0 else None
        return self.watermark + 1 if seq > self.watermark + 1 else None

    async def _fill_gap(self, start: int, seq: int) -> None:
        """Fill the gap ``start .. seq-1`` from the replay socket, else follow the gap policy."""
        self.counters.gaps += 1
        self.warn("gap", "batches %d..%d missed", start, seq - 1)
        self._lost_handled = False
        if self.sub.replay_endpoint and await self._replay_gap(start, seq):
            self.counters.replays += 1
            return
        self.counters.gaps_lost += 1
        self.warn(
            "replay_incomplete", "batches %d..%d lost (%s); %s", start, seq - 1,
            "replay incomplete" if self.sub.replay_endpoint else "no replay endpoint",
            "clearing the rank" if self.limits.gap_policy == "clear" else "carrying on",
        )  # fmt: skip
        self._lost()

    def _lost(self) -> None:
        """Batches were lost for good: the gap policy, once per gap."""
        if self._lost_handled:
            return
        self._lost_handled = True
        if self.limits.gap_policy == "clear":
            self.counters.warnings["gap_cleared"] += 1
            self.sink.clear_kv_rank(self.worker_id, self.dp_rank)

    async def _replay_gap(self, start: int, seq: int) -> bool:
        """Ask the engine for every batch from ``start``; True when ``start .. seq-1`` arrived
        whole and in order (the reference's "Replay incomplete" otherwise)."""
        if self._replay is None:
            self._replay = self._socket(zmq.DEALER)
            self._replay.connect(self.sub.replay_endpoint or "")
        sock = self._replay
        await sock.send_multipart([b"", start.to_bytes(8, "big")])
        deadline = time.monotonic() + self.limits.replay_timeout
        expected, whole = start, True
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not await sock.poll(int(left * 1000) + 1):
                self._close_replay()  # a late answer must not be read as the next one's
                return False
            frames = await sock.recv_multipart()
            if len(frames) == 4 and not frames[0]:  # the engines': [b"", topic, seq, payload]
                seq_frame, payload = frames[2], frames[3]
            elif len(frames) == 3 and not frames[0]:  # older publishers: [b"", seq, payload]
                seq_frame, payload = frames[1], frames[2]
            else:
                self._malformed("malformed_frames", f"replay answer of {len(frames)} frames")
                self._close_replay()
                return False
            if not payload:  # the end marker
                break
            try:
                rseq = decode_seq(seq_frame)
            except MalformedMessage as e:
                self._malformed("malformed_seq", f"replay: {e}")
                self._close_replay()
                return False
            if self.watermark is not None and rseq <= self.watermark:
                continue
            if rseq > seq + self.limits.max_seq_jump:  # not a batch of this stream
                self.warn("seq_out_of_line", "replayed sequence number %d is far past %d;"
                          " replay abandoned", rseq, seq)  # fmt: skip
                self._close_replay()
                return False
            if rseq != expected:  # a hole: what comes after it stands, what fell in it is lost
                whole = False
                self._lost()
            expected = rseq + 1
            self.counters.replayed_batches += 1
            await self._consume(rseq, payload)
        return whole and self.watermark is not None and self.watermark >= seq - 1

    def _close_replay(self) -> None:
        if self._replay is not None:
            self._replay.close(0)
            self._replay = None

    # -- one batch -------------------------------------------------------------------------

    async def _consume(self, seq: int, payload: bytes) -> None:
        """Decode, check and apply the batch ``seq``; it consumes ``seq`` whatever comes of it."""
        try:
            if len(payload) <= INLINE_DECODE_BYTES:
                batch = decode_batch(seq, payload)
            else:
                loop = asyncio.get_running_loop()
                batch = await loop.run_in_executor(self.decoder, decode_batch, seq, payload)
        except MalformedMessage as e:
            self.watermark = seq
            self._malformed("malformed_payload", f"batch {seq}: {e}")
            return
        await self.apply(batch)

    async def apply(self, batch: KvBatch) -> None:
        """Check and apply a decoded batch; it consumes its sequence number either way."""
        seq = self.watermark = batch.seq
        if batch.dp_rank is not None and batch.dp_rank not in self.sub.ranks:
            self.warn("dp_rank_out_of_range", "batch %d names dp_rank %d, not one of the worker's"
                      " (%s); rejected", seq, batch.dp_rank, self.sub.ranks)  # fmt: skip
            return
        blocks = batch_blocks(batch)
        if blocks > self.limits.max_batch_blocks:
            self.warn("batch_too_large", "batch %d carries %d blocks (most %d); rejected", seq,
                      blocks, self.limits.max_batch_blocks)  # fmt: skip
            return
        refused = self.sink.stores_refused
        for _ in apply_in_slices(self.sink, self.worker_id, self.dp_rank, batch):
            await asyncio.sleep(0)  # the loop's turn between slices
        self.counters.batches += 1
        self.counters.events += len(batch.events)
        applied = self.counters.applied
        stores = 0
        for ev in batch.events:
            if isinstance(ev, BlocksStored):
                stores += 1
            else:
                applied["removed" if isinstance(ev, BlocksRemoved) else "cleared"] += 1
        applied["stored"] += stores
        applied["stored_refused"] += min(self.sink.stores_refused - refused, stores)

    def _malformed(self, kind: str, why: str) -> None:
        self.counters.malformed += 1
        self.warn(kind, "malformed message skipped: %s", why)

    def warn(self, kind: str, msg: str, *args: object) -> None:
        """Count ``kind`` and log it, at most once per ``LOG_INTERVAL_S`` for this rank."""
        self.counters.warnings[kind] += 1
        now = time.monotonic()
        last, left_out = self._logged.get(kind, (None, 0))
        if last is not None and now - last < LOG_INTERVAL_S:
            self._logged[kind] = (last, left_out + 1)
            return
        self._logged[kind] = (now, 0)
        more = f" ({left_out} more like it not logged)" if left_out else ""
        log.warning(
            "KV events: worker_id=%d dp_rank=%d: " + msg + "%s",
            self.worker_id, self.dp_rank, *args, more,
        )  # fmt: skip
