"""ZMQ listeners: one SUB socket per schedulable worker rank, and the one connection policy.

Connection policy. A listener connects its SUB socket (subscribed to every topic) to the rank's
``kv_events_endpoint`` and lets libzmq reconnect on its own (``RECONNECT_IVL`` 100 ms, backing
off to ``RECONNECT_IVL_MAX`` 5 s) for as long as the publisher is away; nothing is fatal. Like any
ZMQ subscriber it only receives what is published after its connection is established (the "slow
joiner"): batches published before are gaps, found by the sequence numbers.

Sequence numbers (as the reference, ``services/indexer/listener``): the first batch should be 0 and
each next one the previous plus one. A batch at or below the last one applied is skipped (a
duplicate, or one a replay already delivered). A gap (a first batch above 0 included) is asked
for again from the engine's replay socket (``replay_endpoint``, a vLLM ROUTER: DEALER request of
the start sequence, batches until the end marker); each replayed batch is applied like a live one.
Where the reference then carries on with the batches lost, here a gap that cannot be replayed (no
replay endpoint, a timeout, or a replay that stops short) clears the rank's index and is counted:
an index that silently misses stores or removals would steer prompts by blocks that are gone. A
publisher that starts again from sequence 0 (an engine restart: its cache is empty) also clears the
rank; the reference would skip its batches until their numbers passed the old ones.

A malformed message (framing, msgpack, event shape) is counted, logged (rate-limited) and skipped;
it does not move the sequence watermark, so the next batch shows a gap.

A listener may start from a watermark handed over by another instance together with the index
it describes (``seed``, peer recovery: ``kv_slot_tracker.ingest.peers``, asked as the listener is
created, before it receives anything): its first batch then continues from there, or is a gap
like any other.

Whether each SUB socket is connected (a socket monitor's connect and disconnect events) and how
long each rank has been silent are kept for the metrics and ``/selection/ready``; neither changes
the worker's lifecycle (the reference keeps such a worker schedulable and its blocks indexed).

The manager polls the service's subscriptions (an O(1) version check every ``poll_interval``)
and starts or stops listeners to match; each listener applies a batch to the service in one
synchronous call on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kv_slot_tracker.gc_tuning import release_free_memory

from .port import IngestCounters, KvEventSink, RankKey, Subscription
from .records import (
    END_OF_REPLAY,
    KvBatch,
    MalformedMessage,
    decode_batch,
    decode_message,
    decode_seq,
)

log = logging.getLogger(__name__)

RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 5_000
RCVHWM = 100_000  # messages queued per socket while the loop is busy (vLLM's PUB default)
TRIM_AFTER_BYTES = 4 << 20  # received since the last heap trim: one follows once they drained
TRIM_QUIET_S = 1.0
REPLAY_TIMEOUT_S = 2.0
MAX_LOGGED_ERRORS = 10  # per listener, then one line per 1000


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
        max_message_bytes: int,
        replay_timeout: float = REPLAY_TIMEOUT_S,
    ) -> None:
        self.ctx, self.sink, self.counters = ctx, sink, counters
        self.worker_id, self.dp_rank = key
        self.sub = sub
        self.max_message_bytes = max_message_bytes
        self.replay_timeout = replay_timeout
        self.watermark: int | None = None
        self.last_message_at: float | None = None
        self.started_at = time.monotonic()
        self.connected = False
        """The SUB socket holds a connection to the publisher (socket monitor events)."""
        self.errors = 0

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        s.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        s.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        s.setsockopt(zmq.RCVHWM, RCVHWM)
        return s

    async def run(self) -> None:
        sock = self._socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        replay: zmq.asyncio.Socket | None = None
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        watcher = asyncio.create_task(self._watch(monitor))
        try:
            sock.connect(self.sub.endpoint)
            log.info(
                "KV events: listening worker_id=%d dp_rank=%d endpoint=%s",
                self.worker_id, self.dp_rank, self.sub.endpoint,
            )  # fmt: skip
            while True:
                frames = await sock.recv_multipart()
                self.last_message_at = time.monotonic()
                self.counters.bytes += sum(map(len, frames))
                try:
                    if len(frames) != 3:
                        raise MalformedMessage(
                            f"expected 3 frames (topic, seq, payload), got {len(frames)}"
                        )
                    seq = decode_seq(frames[1])
                except MalformedMessage as e:
                    self._malformed(e)
                    continue
                if self.watermark is not None and seq == 0 and self.watermark > 0:
                    self.counters.restarts += 1
                    log.warning(
                        "KV events: publisher of worker_id=%d dp_rank=%d restarted at sequence 0;"
                        " clearing the rank", self.worker_id, self.dp_rank,
                    )  # fmt: skip
                    self.sink.clear_kv_rank(self.worker_id, self.dp_rank)
                    self.watermark = None
                start = self._gap_start(seq)
                if start is not None:
                    self.counters.gaps += 1
                    if replay is None and self.sub.replay_endpoint:
                        replay = self._socket(zmq.DEALER)
                        replay.connect(self.sub.replay_endpoint)
                    await self._recover(replay, start, seq)
                if self.watermark is not None and seq <= self.watermark:
                    self.counters.stale += 1
                    continue
                try:
                    batch = decode_batch(seq, frames[2])
                except MalformedMessage as e:
                    self._malformed(e)
                    continue
                self._apply(batch)
        finally:  # no await here: a second cancellation must not skip the closing
            watcher.cancel()
            self.connected = False
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)
            if replay is not None:
                replay.close(0)

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        """Follow the SUB socket's connection (monitor events; anything else is ignored)."""
        while True:
            frames = await monitor.recv_multipart()
            try:
                event = parse_monitor_message(frames)["event"]
            except Exception:  # a monitor message libzmq did not document: not ours to judge
                continue
            if event == zmq.EVENT_CONNECTED:
                self.connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                self.connected = False
                log.info(
                    "KV events: publisher of worker_id=%d dp_rank=%d disconnected; reconnecting",
                    self.worker_id, self.dp_rank,
                )  # fmt: skip

    def _gap_start(self, seq: int) -> int | None:
        if self.watermark is None:
            return 0 if seq > 0 else None
        return self.watermark + 1 if seq > self.watermark + 1 else None

    async def _recover(self, replay: zmq.asyncio.Socket | None, start: int, seq: int) -> None:
        """Fill the gap ``start .. seq-1`` from the replay socket, or clear the rank."""
        if replay is not None and await self._replay(replay, start, seq):
            self.counters.replays += 1
            return
        self.counters.gaps_lost += 1
        log.warning(
            "KV events: batches %d..%d of worker_id=%d dp_rank=%d lost (%s); clearing the rank",
            start, seq - 1, self.worker_id, self.dp_rank,
            "replay failed" if replay is not None else "no replay endpoint",
        )  # fmt: skip
        self.sink.clear_kv_rank(self.worker_id, self.dp_rank)
        self.watermark = seq - 1

    async def _replay(self, replay: zmq.asyncio.Socket, start: int, seq: int) -> bool:
        """Ask for every batch from ``start``; True when the gap up to ``seq`` is filled."""
        # drop answers to an earlier request that timed out
        while await replay.poll(0):
            await replay.recv_multipart()
        await replay.send_multipart([b"", start.to_bytes(8, "big")])
        deadline = time.monotonic() + self.replay_timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not await replay.poll(int(left * 1000)):
                return False
            frames = await replay.recv_multipart()
            if len(frames) < 3:
                self._malformed(MalformedMessage(f"replay: {len(frames)} frames"))
                return False
            try:
                rseq = decode_seq(frames[1])
            except MalformedMessage as e:
                self._malformed(e)
                return False
            if not frames[2] or rseq == (END_OF_REPLAY & ((1 << 64) - 1)):
                break
            if self.watermark is not None and rseq <= self.watermark:
                continue
            if self.watermark is not None and rseq != self.watermark + 1:
                return False  # the engine's buffer no longer reaches back to the gap
            if self.watermark is None and rseq != start:
                return False
            try:
                batch = decode_batch(rseq, frames[2])
            except MalformedMessage as e:
                self._malformed(e)
                return False
            self.counters.replayed_batches += 1
            self._apply(batch)
        return self.watermark is not None and self.watermark >= seq - 1

    def _apply(self, batch: KvBatch) -> None:
        self.sink.apply_kv_batch(self.worker_id, self.dp_rank, batch)
        self.watermark = batch.seq
        self.counters.batches += 1
        self.counters.events += len(batch.events)

    def _malformed(self, e: MalformedMessage) -> None:
        self.counters.malformed += 1
        self.errors += 1
        if self.errors <= MAX_LOGGED_ERRORS or self.errors % 1000 == 0:
            log.warning(
                "KV events: malformed message from worker_id=%d dp_rank=%d skipped (%d so far):"
                " %s", self.worker_id, self.dp_rank, self.errors, e,
            )  # fmt: skip


class ZmqIngest:
    """Keeps one ``RankListener`` per subscription the service wants."""

    def __init__(
        self,
        sink: KvEventSink,
        *,
        max_message_bytes: int = 64 << 20,
        poll_interval: float = 0.05,
        replay_timeout: float = REPLAY_TIMEOUT_S,
    ) -> None:
        self.sink = sink
        self.counters = IngestCounters()
        self.max_message_bytes = max_message_bytes
        self.poll_interval = poll_interval
        self.replay_timeout = replay_timeout
        self.ctx = zmq.asyncio.Context()
        self.listeners: dict[RankKey, tuple[Subscription, RankListener, asyncio.Task]] = {}
        self.seed: Callable[[RankKey], int | None] | None = None
        """Asked for a rank's starting watermark as its listener is created (peer recovery)."""
        self._version: int | None = None
        self._task: asyncio.Task | None = None
        self._trimmed_at = 0  # counters.bytes at the last heap trim

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kv-events-ingest")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for key in list(self.listeners):
            await self._stop_listener(key)
        self.ctx.destroy(linger=0)  # closes any socket a listener left open

    async def _run(self) -> None:
        while True:
            try:
                version = self.sink.kv_subscriptions_version
                if version != self._version:
                    self._version = version
                    await self.reconcile()
                self._trim_after_burst(time.monotonic())
            except Exception:  # never let the manager die
                log.exception("KV events: reconciling listeners failed")
            await asyncio.sleep(self.poll_interval)

    def _trim_after_burst(self, now: float) -> None:
        """Once at least ``TRIM_AFTER_BYTES`` of messages arrived since the last trim and no
        listener got a message for ``TRIM_QUIET_S``, give the C heap's free pages back.

        A burst the loop cannot keep up with queues in libzmq's receive pipes, allocated by
        its I/O thread in a glibc arena of its own (about 5 KB per 1.1 KB message measured:
        the decoder's shared buffers and the pipes' chunks); once the loop drained them the
        arena is mostly free but glibc keeps the pages, which after a 100,000-block burst was
        more than the index itself (``bench/RESULTS.md``, "what holds a burst's memory").
        Counted in bytes, not batches: what queues is bytes, and a burst of a few thousand
        large batches holds as much as one of many small ones."""
        if self.counters.bytes - self._trimmed_at < TRIM_AFTER_BYTES:
            return
        last = max((lst.last_message_at or 0.0 for _, lst, _ in self.listeners.values()),
                   default=0.0)  # fmt: skip
        if now - last >= TRIM_QUIET_S:
            self._trimmed_at = self.counters.bytes
            if release_free_memory():
                self.counters.heap_trims += 1

    async def reconcile(self) -> None:
        wanted = self.sink.kv_subscriptions()
        for key, (sub, _, _) in list(self.listeners.items()):
            if wanted.get(key) != sub:
                await self._stop_listener(key)
        for key, sub in wanted.items():
            if key not in self.listeners:
                listener = RankListener(
                    self.ctx, self.sink, self.counters, key, sub,
                    max_message_bytes=self.max_message_bytes, replay_timeout=self.replay_timeout,
                )  # fmt: skip
                if self.seed is not None:
                    listener.watermark = self.seed(key)
                task = asyncio.create_task(self._guard(listener), name=f"kv-events-{key}")
                self.listeners[key] = (sub, listener, task)

    async def _guard(self, listener: RankListener) -> None:
        """Run a listener; an unexpected error restarts it after a pause (never fatal)."""
        while True:
            try:
                await listener.run()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception(
                    "KV events: listener worker_id=%d dp_rank=%d failed; restarting",
                    listener.worker_id, listener.dp_rank,
                )  # fmt: skip
                await asyncio.sleep(RECONNECT_IVL_MAX_MS / 1000)

    async def _stop_listener(self, key: RankKey) -> None:
        _, _, task = self.listeners.pop(key)
        task.cancel()
        # wait without swallowing a cancellation of the caller (the manager being stopped)
        await asyncio.wait([task])
        if not task.cancelled() and task.exception() is not None:
            log.error("KV events: listener %s ended with %r", key, task.exception())

    def watermark(self, key: RankKey) -> int | None:
        """The last sequence number applied on ``key``'s socket (None: none, or no listener)."""
        have = self.listeners.get(key)
        return None if have is None else have[1].watermark

    def disconnected(self) -> list[RankKey]:
        """The listening ranks whose SUB socket holds no connection to the publisher now."""
        return sorted(key for key, (_, lst, _) in self.listeners.items() if not lst.connected)

    def silent(self, seconds: float, now: float | None = None) -> list[RankKey]:
        """The listening ranks that received nothing for ``seconds`` (since they started
        listening, when they never received anything)."""
        now = time.monotonic() if now is None else now
        return sorted(
            key
            for key, (_, lst, _) in self.listeners.items()
            if now - (lst.last_message_at or lst.started_at) >= seconds
        )

    def silent_for(self, now: float | None = None) -> dict[RankKey, float | None]:
        """Seconds since each listener's last message (``None``: nothing received yet)."""
        now = time.monotonic() if now is None else now
        return {
            key: None if lst.last_message_at is None else now - lst.last_message_at
            for key, (_, lst, _) in self.listeners.items()
        }


__all__ = ["RankListener", "ZmqIngest", "decode_message"]
