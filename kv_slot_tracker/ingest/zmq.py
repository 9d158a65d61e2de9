"""The ZMQ ingest: one listener (``kv_slot_tracker.ingest.listener``) per schedulable worker
rank the service subscribes to. It polls the service's subscriptions (an O(1) version check every
``poll_interval``) and starts or stops listeners to match; a listener that fails unexpectedly is
restarted after a pause. After a burst of messages it gives the C heap's free pages back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import zmq.asyncio

from kv_slot_tracker.gc_tuning import release_free_memory

from .listener import (
    RECONNECT_IVL_MAX_MS,
    REPLAY_TIMEOUT_S,
    GapPolicy,
    ListenerLimits,
    RankListener,
)
from .port import IngestCounters, KvEventSink, RankKey, Subscription

log = logging.getLogger(__name__)

TRIM_AFTER_BYTES = 4 << 20  # received since the last heap trim: one follows once they drained
TRIM_QUIET_S = 1.0


class ZmqIngest:
    """Keeps one ``RankListener`` per subscription the service wants."""

    def __init__(
        self,
        sink: KvEventSink,
        *,
        max_message_bytes: int = 16 << 20,
        poll_interval: float = 0.05,
        replay_timeout: float = REPLAY_TIMEOUT_S,
        max_batch_blocks: int = 16_384,
        max_seq_jump: int = 100_000,
        gap_policy: GapPolicy = "continue",
    ) -> None:
        self.sink = sink
        self.counters = IngestCounters()
        self.limits = ListenerLimits(
            max_message_bytes=max_message_bytes, max_batch_blocks=max_batch_blocks,
            max_seq_jump=max_seq_jump, gap_policy=gap_policy, replay_timeout=replay_timeout,
        )  # fmt: skip
        self.poll_interval = poll_interval
        self.ctx = zmq.asyncio.Context()
        self.decoder = ThreadPoolExecutor(1, thread_name_prefix="kv-events-decode")
        """Decodes the large payloads off the event loop, one at a time."""
        self.listeners: dict[RankKey, tuple[Subscription, RankListener, asyncio.Task[None]]] = {}
        self.seed: Callable[[RankKey], int | None] | None = None
        """Asked for a rank's starting watermark as its listener is created (peer recovery)."""
        self._version: int | None = None
        self._task: asyncio.Task[None] | None = None
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
        self.decoder.shutdown(wait=False, cancel_futures=True)

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
                    limits=self.limits, decoder=self.decoder,
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

    def statuses(self, silent_seconds: float, now: float | None = None) -> dict[RankKey, str]:
        """Each listening rank's state: ``disconnected`` (no connection to its publisher),
        ``silent`` (connected, nothing received for ``silent_seconds``) or ``active``."""
        now = time.monotonic() if now is None else now
        out = {}
        for key, (_, lst, _) in self.listeners.items():
            if not lst.connected:
                out[key] = "disconnected"
            elif now - (lst.last_message_at or lst.started_at) >= silent_seconds:
                out[key] = "silent"
            else:
                out[key] = "active"
        return out

    def silent_for(self, now: float | None = None) -> dict[RankKey, float | None]:
        """Seconds since each listener's last message (``None``: nothing received yet)."""
        now = time.monotonic() if now is None else now
        return {
            key: None if lst.last_message_at is None else now - lst.last_message_at
            for key, (_, lst, _) in self.listeners.items()
        }
