"""The write path: local first, then the stream.

The service mutates its trackers, then hands a record (its bytes) to ``publish``, which wraps
it in the stream's envelope (origin, ``incarnation``, ``seq``, the producer's time:
``records.encode_entry``) and puts it in a bounded outbox without awaiting anything; a full
outbox drops the newest record (counted, logged at most every 30 s). One publisher task drains
the outbox in batches (``replication_batch_events`` records, or ``replication_batch_ms`` after
the first) and appends each batch to ``{ns}:events`` in one round trip, trimming entries older
than ``stream_retention_seconds``. On a Redis error it keeps the batch, backs off (exponential
with jitter, at most ~1 s) and retries, so nothing within the outbox capacity is lost to an
outage.

Durable acknowledgements (``replication_ack = "redis"``). A caller notes ``last_accepted_seq``
after its change and awaits ``appended(seq)``: one future per waiting call, resolved after the
append of the batch holding its last record returns (with ``replication_ack_replicas = N``:
after the ``WAIT N`` sent in the same round trip confirmed N replicas hold it; a WAIT that
falls short releases nobody, the calls answer 503 at their timeout, and new calls are refused
for a second before the next append tries again). Calls waiting at one moment therefore
share one append round trip (group commit; ``group_commit`` observes how many). Before applying
a change, a caller asks ``refusal()``: while the publisher is known to be cut off from Redis
(its last append failed, or the running one has not returned for longer than the ack timeout)
the call is refused, so it changes nothing. Since a refused call queues nothing, a publisher
cut off with nothing to append reconnects on its own (``CONFIRM_SCRIPT`` with backoff, its WAIT
too when replicas are waited for): the refusal always ends once Redis answers, with no client.

The append is a short script (``stream.APPEND_SCRIPT``) rather than a plain pipeline so it can
refuse to append when the stream no longer holds this publisher's previous entry (Redis
restarted without persistence, or failed over to a lagging replica): the publisher then
re-sends what it appended in the last 30 s first, keeping its records in order for readers, and
asks for a snapshot at once.
"""

from __future__ import annotations

import hashlib
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError, OutOfMemoryError, ResponseError

from kv_slot_tracker.core.types import NS_PER_MS, NS_PER_S
from kv_slot_tracker.replication.queue import (
    Acks,
    EventQueue,
    PublishQueueClosed,
    PublishQueueError,
    collect_batch,
    wait_acknowledged,
)
from kv_slot_tracker.replication.records import encode_entry, encode_entry_1, record_bytes
from kv_slot_tracker.replication.redis.connection import (
    IO_ERRORS,
    backoff_delay,
    honour_cancellation,
    retrying,
)
from kv_slot_tracker.replication.redis.instance import Instance
from kv_slot_tracker.replication.redis.schedule import SnapshotSchedule
from kv_slot_tracker.replication.redis.stream import APPEND_SCRIPT, CONFIRM_SCRIPT, id_text

log = logging.getLogger(__name__)

RESEND_WINDOW_NS = 30 * NS_PER_S
DROP_LOG_INTERVAL_NS = 30 * NS_PER_S
DEGRADED_AFTER_DROP_NS = 60 * NS_PER_S
# After a WAIT fell short, calls are refused (503 before they change anything) for this long;
# then they are let through again, and the next append's WAIT tells whether replicas are back.
REPLICAS_RETRY_NS = 1 * NS_PER_S
FULL = "Redis is out of memory (maxmemory, noeviction) and refuses appends"
EXHAUSTED = (
    "stream_exhausted: the stream has exhausted the last possible id and refuses appends "
    "(see docs/redis-ha.md: after a snapshot, delete or rename the stream key)"
)
EXHAUSTED_ERROR = "exhausted the last possible id"  # Redis's words (any case), in a ResponseError
# While calls wait for records already appended and nothing new comes to append, the publisher
# asks the replicas again this often (``_confirm``).
CONFIRM_IDLE_S = 0.2


class PublishQueueBytes(PublishQueueError):
    """The outbox holds ``outbox_max_bytes`` of records already."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(f"replication outbox holds its {max_bytes} bytes of records")


# Redis memory of a stream entry from its payload's length, kept from above (measured with
# MEMORY USAGE on Redis 7.0: 71 / 243 / 768 bytes an entry for payloads of 50 / 200 / 600 bytes)
ENTRY_BYTES_FACTOR = 1.3
ENTRY_BYTES_EXTRA = 24


class Outbox:
    def __init__(self, instance: Instance, schedule: SnapshotSchedule) -> None:
        self.me = instance  # who we are, our clocks and counters
        self.settings = instance.settings
        self.counters = instance.counters
        self.schedule = schedule
        self.capacity = self.settings.outbox_capacity
        self._queue: EventQueue[tuple[int, bytes]] = EventQueue(self.capacity)  # (seq, entry)
        # the stream format written (``replication_stream_format``)
        self._entry = (
            encode_entry_1 if self.settings.replication_stream_format == 1 else encode_entry
        )
        self._next_seq = 1
        self._last_appended = ""  # stream id of our newest appended entry
        # SHA-1 (hex) of its payload: after a failover another instance's entry may hold that id
        self._last_digest = ""
        # a client's prompts make the records: bounded in bytes too (``outbox_max_bytes``)
        self.max_bytes = self.settings.outbox_max_bytes
        self.queued_bytes = 0  # ``record_bytes`` of the records queued
        self._payload_bytes = 0  # of every record appended, for the stream's byte bound
        self._payload_count = 0
        self._recent: deque[tuple[int, bytes]] = deque()  # (wall ns, payload) to re-send
        self._recent_bytes = 0
        self._last_drop_ns: int | None = None
        self._last_drop_log_ns: int | None = None
        self._drops_since_log = 0
        self.connected: bool | None = None  # None until the first append was tried
        self.appended_seq = 0  # our highest sequence number known to be in the stream
        # ... and known to be held by ``replication_ack_replicas`` replicas too (WAIT)
        self.confirmed_seq = 0
        self.replicas = self.settings.replication_ack_replicas
        self._short_since: int | None = None  # clock ns: the last WAIT fell short then
        self._full_since: int | None = None  # clock ns: Redis refused appends for memory
        self._exhausted_since: int | None = None  # monotonic ns: appends refused, stream full
        self._short_logged: int | None = None
        self._acks: Acks = deque()  # (seq, waiting call)
        self._append_started: int | None = None  # clock ns: an append running since then
        self.group_commit: Callable[[int], None] | None = None  # observes calls per append
        # the append script, bound to the client by connect(): ``append(keys=..., args=...)``
        self.append: Any = None
        self._client: Redis | None = None
        self._replicas_held = 0  # what the last WAIT answered
        self._probes = 0  # reconnection attempts with nothing to append (``run``)
        self._over_logged: int | None = None  # clock ns: stream over twice its bound, logged

    def connect(self, client: Redis) -> None:
        """``client``: a connection pool of the publisher's own, so that WAIT after an append
        follows that append on the same connection."""
        self._client = client
        self.append = client.register_script(APPEND_SCRIPT)
        self.confirm = client.register_script(CONFIRM_SCRIPT)

    # -- accepting records ------------------------------------------------------------------

    def publish(self, record: bytes, ts: int) -> int:
        """Queue one record for the stream; never blocks, never raises. Returns its sequence
        number (0 when it was dropped)."""
        seq = self._next_seq
        entry = self._entry(self.me.instance_id, self.me.incarnation, seq, ts, record)
        size = record_bytes(entry)
        try:
            if self.queued_bytes + size > self.max_bytes and len(self._queue):
                raise PublishQueueBytes(self.max_bytes)
            self._queue.try_send((seq, entry))
        except PublishQueueError as e:
            self._dropped(e)
            return 0
        self.queued_bytes += size
        self._next_seq = seq + 1  # only accepted records use up a number
        return seq

    def _dropped(self, error: PublishQueueError) -> None:
        self.counters.dropped += 1
        if isinstance(error, PublishQueueClosed):
            log.debug("replication outbox closed; dropping a record during shutdown")
            return
        now = self.me.clock()
        self._last_drop_ns = now
        self._drops_since_log += 1
        last = self._last_drop_log_ns
        if last is None or now - last >= DROP_LOG_INTERVAL_NS:
            log.error(
                "replication outbox full (capacity=%d records, %d bytes); dropping newest record; "
                "%d dropped since the last message, %d in total",
                self.capacity,
                self.max_bytes,
                self._drops_since_log,
                self.counters.dropped,
            )
            self._last_drop_log_ns = now
            self._drops_since_log = 0

    @property
    def next_seq(self) -> int:
        """The number the next accepted record gets."""
        return self._next_seq

    @property
    def last_accepted_seq(self) -> int:
        return self._next_seq - 1

    @property
    def last_appended(self) -> str:
        """Stream id of our newest appended entry ("" before the first, or after a reset)."""
        return self._last_appended

    def pending(self) -> int:
        """Accepted records not yet appended (queued, being batched, or in flight)."""
        return self._next_seq - 1 - self.counters.published

    def degraded_reasons(self) -> list[str]:
        reasons = [FULL] if self._full_since is not None else []
        if self._exhausted_since is not None:
            reasons.append(EXHAUSTED)
        if len(self._queue) >= 0.9 * self.capacity:
            reasons.append("outbox nearly full")
        if self._short_since is not None:
            reasons.append("Redis replicas not confirming appends")
        last_drop = self._last_drop_ns
        if last_drop is not None and self.me.clock() - last_drop < DEGRADED_AFTER_DROP_NS:
            reasons.append("records dropped in the last minute")
        return reasons

    def close(self) -> None:
        """Shutting down: later records are dropped; the publisher drains what is queued."""
        self._queue.shutting_down = True
        self._queue.close()

    # -- the publisher task -----------------------------------------------------------------

    async def run(self) -> None:
        max_events = self.settings.replication_batch_events
        max_ns = self.settings.replication_batch_ms * NS_PER_MS
        while True:
            honour_cancellation()
            if self.connected is False and not self._queue.closed:
                # Cut off and nothing to append: a refused call queues nothing, so no append
                # would ever find Redis again. Reconnect on our own schedule instead.
                self._probes += 1
                if not await self._queue.wait_ready(backoff_delay(self._probes)):
                    await self._confirm()
                    continue
            # With replicas to wait for, an idle publisher looks up every CONFIRM_IDLE_S: calls
            # may wait for records appended but not confirmed yet (a call that queued nothing
            # waits for earlier records too), and nothing new may come whose append's WAIT
            # would answer for them: then it asks the replicas again.
            if self.replicas and not await self._queue.wait_ready(CONFIRM_IDLE_S):
                if self._calls_waiting() and self.confirmed_seq < self.appended_seq:
                    await self._confirm()
                continue
            batch, stop = await collect_batch(
                self._queue,
                max_events=max_events,
                max_duration_ns=max_ns,
                clock=self.me.clock,
            )
            if batch:
                await self._append_batch(batch)
            if stop:
                return

    async def _append_batch(self, batch: list[tuple[int, bytes]]) -> None:
        """Append until it succeeds; the batch is kept across any number of Redis errors."""
        payloads = [entry for _, entry in batch]
        self.queued_bytes -= sum(map(record_bytes, payloads))
        self._append_started = self.me.clock()
        await retrying(lambda: self._append_payloads(payloads), self._append_failed)
        self._append_started = None
        self.counters.published += len(payloads)
        if self._full_since is not None:
            log.info("Redis accepts appends again; the outbox is draining")
            self._full_since = None
        if self._exhausted_since is not None:
            log.info("the stream accepts appends again (re-created); the outbox is draining")
            self._exhausted_since = None
        self._set_connected(True)
        self.appended_seq = batch[-1][0]
        if self._held_by_replicas():
            # WAIT counts every write before it: all our earlier appends are held too
            self.confirmed_seq = self.appended_seq
            if self._acks:
                self._acknowledge()

    # -- durable acknowledgements -----------------------------------------------------------

    def refusal(self, stall_ns: int) -> str | None:
        """Why a change must not be accepted now (None: it may): the publisher is known to be
        cut off from Redis, or its running append has not returned for ``stall_ns``."""
        if self.connected is False:
            return "Redis unreachable"
        if self._full_since is not None:
            return FULL
        short = self._short_since
        if short is not None and self.me.clock() - short < REPLICAS_RETRY_NS:
            return "Redis replicas not confirming"
        started = self._append_started
        if started is not None and self.me.clock() - started > stall_ns:
            return "Redis not answering"
        if self._queue.closed:
            return "shutting down"
        return None

    async def appended(self, seq: int, timeout_s: float) -> bool:
        """Until our records up to ``seq`` are in the stream (True), at most ``timeout_s``."""
        if seq <= self.confirmed_seq:
            return True
        return await wait_acknowledged(self._acks, seq, timeout_s)

    def _acknowledge(self) -> None:
        """Release the calls whose records the last append took (one group commit)."""
        acks, appended, released = self._acks, self.confirmed_seq, 0
        while acks and acks[0][0] <= appended:
            _, done = acks.popleft()
            if not done.done():
                done.set_result(True)
                released += 1
        if released and self.group_commit is not None:
            self.group_commit(released)

    def _max_entries(self, payloads: list[bytes]) -> int:
        """The stream's bound in entries for this append: ``stream_max_entries``, lowered so
        the entries fit ``stream_max_bytes`` at the mean size of the records appended so far
        (a Redis stream can only be trimmed by count; 0 = no bound). The script trims to it
        only what the newest snapshot covers (``stream.APPEND_SCRIPT``)."""
        cap = self.settings.stream_max_entries
        budget = self.settings.stream_max_bytes
        if not budget:
            return cap
        self._payload_bytes += sum(map(len, payloads))
        self._payload_count += len(payloads)
        entry = self._payload_bytes / self._payload_count * ENTRY_BYTES_FACTOR + ENTRY_BYTES_EXTRA
        by_bytes = max(1, int(budget // entry))
        return by_bytes if cap == 0 else min(cap, by_bytes)

    def _trim_horizon(self) -> str:
        retention_ms = self.settings.stream_retention_seconds * 1000
        return str(max(0, self.me.wall_clock() // NS_PER_MS - retention_ms))

    async def _append_call(self, last: str, payloads: list[bytes]) -> list[Any] | None:
        """One append (``stream.APPEND_SCRIPT``): the new ids, None when ``last`` is gone.

        With ``replication_ack_replicas`` the same round trip (a pipeline, hence the same
        connection) runs ``WAIT replicas timeout`` after the script; ``_replicas_held`` keeps
        how many replicas confirmed."""
        keys = [self.me.keys.events, self.me.keys.reset, self.me.keys.snapshot]
        digest = self._last_digest if last else ""
        args: list[Any] = [last, self._trim_horizon(), self._max_entries(payloads), digest]
        args += payloads
        if not self.replicas:
            return self._trimmed(await self.append(keys=keys, args=args))
        assert self._client is not None
        for _ in range(2):
            # EVALSHA rather than the pipeline's script support, which checks every time
            pipe = self._client.pipeline(transaction=False)
            pipe.evalsha(self.append.sha, len(keys), *keys, *args)
            pipe.wait(self.replicas, self._wait_ms())
            try:
                reply, held = await pipe.execute()
            except NoScriptError:  # a new primary, or a restarted one: load it, once
                await self._client.script_load(APPEND_SCRIPT)
                continue
            self._replicas_held = int(held)
            return self._trimmed(reply)
        raise NoScriptError("the append script could not be loaded")

    def _trimmed(self, reply: list[Any] | None) -> list[Any] | None:
        """The ids of an append's reply; asks for a snapshot when the stream's bound needs a
        newer one to trim further (the script trims only what the newest snapshot covers)."""
        if reply is None:
            return None
        want = int(reply[0])
        if want:
            self.schedule.request_for_bound(id_text(reply[-1]))
        if want == 2:
            now = self.me.clock()
            if self._over_logged is None or now - self._over_logged >= DROP_LOG_INTERVAL_NS:
                self._over_logged = now
                log.error(
                    "the replica stream reached its bound (stream_max_entries / "
                    "stream_max_bytes) before a snapshot covered its entries, and was cut to "
                    "it regardless: instances that need the entries cut wait for a snapshot; "
                    "raise the bound or lower snapshot_interval_seconds"
                )
        return reply[1:]

    def _calls_waiting(self) -> bool:
        """Whether a call still waits for an acknowledgement (those that gave up are dropped)."""
        acks = self._acks
        while acks and acks[0][1].done():
            acks.popleft()
        return bool(acks)

    async def _confirm(self) -> None:
        """Ask Redis again without appending (``stream.CONFIRM_SCRIPT``), and with replicas to
        wait for, WAIT for them: for calls waiting while nothing new comes to append, and to
        reconnect while cut off with nothing to append. If the stream lost our last record
        meanwhile, re-send the recent ones (with their WAITs)."""
        assert self._client is not None
        keys = [self.me.keys.events, self.me.keys.ack_probe]
        args = [self._last_appended, str(self.me.instance_id), self._last_digest]
        try:
            for _ in range(2):
                pipe = self._client.pipeline(transaction=False)
                pipe.evalsha(self.confirm.sha, len(keys), *keys, *args)
                if self.replicas:
                    pipe.wait(self.replicas, self._wait_ms())
                try:
                    reply = await pipe.execute()
                except NoScriptError:
                    await self._client.script_load(CONFIRM_SCRIPT)
                    continue
                if self.replicas:
                    self._replicas_held = int(reply[1])
                if not reply[0]:
                    await self._resend_recent()
                break
        except IO_ERRORS as e:
            self._set_connected(False, e)
            return
        self._set_connected(True)
        if self._held_by_replicas():
            self.confirmed_seq = self.appended_seq
            self._acknowledge()

    def _wait_ms(self) -> int:
        """How long WAIT may wait: less than the calls' own timeout, so that when they time out
        the publisher already knows the replicas fell short (and refuses new calls)."""
        return max(1, self.settings.replication_ack_timeout_ms * 4 // 5)

    def _held_by_replicas(self) -> bool:
        """Whether the last append reached ``replication_ack_replicas`` replicas (WAIT)."""
        if not self.replicas:
            return True
        held = self._replicas_held
        if held >= self.replicas:
            if self._short_since is not None:
                log.info("Redis replicas confirm appends again (%d of %d)", held, self.replicas)
            self._short_since = None
            return True
        now = self.me.clock()
        self._short_since = now
        if self._short_logged is None or now - self._short_logged >= DROP_LOG_INTERVAL_NS:
            self._short_logged = now
            log.warning(
                "only %d of %d Redis replicas confirmed an append within %d ms: calls are not "
                "acknowledged (503) until they do",
                held,
                self.replicas,
                self._wait_ms(),
            )
        return False

    async def _append_payloads(self, payloads: list[bytes]) -> None:
        ids = await self._append_call(self._last_appended, payloads)
        if ids is None:  # our previous entry is gone: re-send recent records first
            await self._resend_recent()
            ids = await self._append_call("", payloads)
        self._appended(ids, payloads)  # type: ignore[arg-type]  # just re-sent: not gone
        now = self.me.wall_clock()
        recent = self._recent
        recent.extend((now, p) for p in payloads)
        self._recent_bytes += sum(map(len, payloads))
        horizon = now - self._resend_window_ns()
        while recent and (
            recent[0][0] < horizon
            or len(recent) > self.capacity
            or self._recent_bytes > self.max_bytes
        ):
            self._recent_bytes -= len(recent.popleft()[1])

    def _appended(self, ids: list[Any], payloads: list[bytes]) -> None:
        """Remember the newest entry appended: its id, and the digest of what it holds."""
        self._last_appended = id_text(ids[-1])
        self._last_digest = hashlib.sha1(payloads[-1], usedforsecurity=False).hexdigest()

    def _resend_window_ns(self) -> int:
        return min(RESEND_WINDOW_NS, self.settings.stream_retention_seconds * NS_PER_S)

    async def _resend_recent(self) -> None:
        """Re-send the records of the resend window after Redis lost our last one.

        Older records now exist only in the instances' memory: whatever happens here, ask for a
        snapshot right away (an instance with the full state writes one) so that starting
        instances, which wait for it, need not wait for the periodic round.
        """
        window = self._resend_window_ns()
        horizon = self.me.wall_clock() - window
        recent = self._recent
        while recent and recent[0][0] < horizon:
            self._recent_bytes -= len(recent.popleft()[1])
        self._last_appended = ""
        self.schedule.request_now()
        if not recent:
            return
        payloads = [p for _, p in recent]
        log.warning(
            "Redis no longer holds this instance's last replica record (restarted without "
            "persistence or failed over); re-sending the %d records of the last %d s",
            len(payloads),
            window // NS_PER_S,
        )
        step = self.settings.replication_batch_events
        for i in range(0, len(payloads), step):
            ids = await self._append_call("", payloads[i : i + step])
            self._appended(ids, payloads[i : i + step])  # type: ignore[arg-type]  # "": never gone
        self.counters.resent += len(payloads)

    def _append_failed(self, error: Exception) -> None:
        if isinstance(error, OutOfMemoryError):  # maxmemory with noeviction: Redis is up but full
            self._refused_for_memory(error)
        elif isinstance(error, ResponseError) and EXHAUSTED_ERROR in str(error).lower():
            self._refused_exhausted(error)
        else:
            self._set_connected(False, error)

    def _refused_exhausted(self, error: BaseException) -> None:
        """Redis answered but the stream can take no entry any more: someone added one with the
        largest possible id. Not an outage: named as such, counted once per episode, records
        kept in the outbox until the stream key is deleted or renamed (then re-created)."""
        self._set_connected(True)
        if self._exhausted_since is None:
            self._exhausted_since = self.me.clock()
            total = self.counters.anomaly("stream_exhausted", self.me.wall_clock())
            log.error(
                "replication anomaly stream_exhausted (%s): the stream %s has exhausted the last "
                "possible id (an entry with the largest id was added), so every append is "
                "refused; records are kept in the outbox (up to %d). Way out: make sure a "
                "snapshot was written after the bad entry (POST /replication/snapshot), then "
                "delete or rename the stream key; the instances re-create it on their next "
                "append and re-read it (%d such so far)",
                error,
                self.me.keys.events,
                self.capacity,
                total,
            )

    def _refused_for_memory(self, error: BaseException) -> None:
        """Redis answered but refused the append: it is at ``maxmemory`` and may not evict (the
        stream must never be evicted). Changes are refused with 503 while it lasts, records
        stay in the outbox, and the append is retried."""
        self.counters.write_refused += 1
        if self._full_since is None:
            self._full_since = self.me.clock()
            log.error(
                "%s (%s): changes are refused with 503 with durable acknowledgements, records "
                "are kept in the outbox (up to %d) and appended once Redis has room; raise "
                "maxmemory or lower stream_retention_seconds / stream_max_entries",
                FULL,
                error,
                self.capacity,
            )

    def _set_connected(self, ok: bool, error: BaseException | None = None) -> None:
        was = self.connected
        self.connected = ok
        if ok:
            self._probes = 0
            if was is False:
                log.info("replication publisher reconnected to Redis")
            return
        if was is not False:
            log.warning(
                "replication publisher lost Redis (%s); buffering up to %d records, retrying",
                error,
                self.capacity,
            )
