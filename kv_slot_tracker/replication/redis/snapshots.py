"""Snapshots of a whole instance in Redis: what a starting (or lagging) instance loads first.

A snapshot is the state of every tracker (``ReplicatedState.export_state``), the stream id up to
which that state includes every record, and the sequence ledger matching it. Loading it and then
reading the stream after that id, skipping records the ledger already counts, gives the same
state as having read the whole stream. Own records queued or appended after a snapshot was taken
are counted in its ledger, since its state includes them.

Every ``snapshot_interval_seconds`` one instance (under a ``SET NX PX`` lease) writes one
(``SnapshotWriter``). Stored as one hash ``{ns}:snapshot`` with small fields (``id``, ``at``,
``origin``) next to the msgpack blob (``data``), so peers can check its age without fetching it
(``SnapshotStore``). Writers take turns under the lease and write through a script that checks
they still hold it.

When an instance finds that Redis lost data (its own last record is gone, or the stream was
recreated or rolled back), it sets ``{ns}:reset`` and asks for a snapshot at once
(``kv_slot_tracker.replication.redis.schedule``), written without the lease if need be: the stream may now
begin with records re-sent out of their original cross-instance order, or after a gap, so a
starting instance waits for a snapshot written after that (each write deletes the key) instead of
replaying the stream.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import msgpack
from redis.asyncio import Redis

from kv_slot_tracker.core.types import NS_PER_MS
from kv_slot_tracker.replication.port import ReplicatedState
from kv_slot_tracker.replication.records import OriginKey, SeqLedger, random_id
from kv_slot_tracker.replication.redis.bootstrap import Bootstrap
from kv_slot_tracker.replication.redis.connection import IO_ERRORS, honour_cancellation
from kv_slot_tracker.replication.redis.schedule import SnapshotSchedule
from kv_slot_tracker.replication.redis.stream import (
    WRITE_SNAPSHOT_SCRIPT,
    NamespaceKeys,
    parse_id,
)

if TYPE_CHECKING:
    from kv_slot_tracker.replication.redis.instance import Instance


class ReadPosition(Protocol):
    """What a snapshot reads of the stream reader (``StreamReader`` has it)."""

    connected: bool | None
    position: str  # the stream id up to which the local state has read
    catching_up: bool  # re-reading a stream found switched: the state lacks records

    def applied_seq(self, key: OriginKey) -> int: ...
    def ledger_copy(self) -> SeqLedger: ...
    def forget_silent_origins(self) -> None: ...


class OwnPosition(Protocol):
    """What a snapshot reads of the outbox (``Outbox`` has it)."""

    @property
    def last_accepted_seq(self) -> int: ...


log = logging.getLogger(__name__)

SNAPSHOT_FORMAT = 1
BOUND_RETRY_S = 0.05  # a snapshot for the bound waits this long for the reader to catch up


@contextmanager
def gc_paused(freeze: bool = False) -> Iterator[None]:
    """No cyclic garbage collection while a snapshot's objects are built or walked.

    A snapshot creates or visits millions of small objects; the collector would otherwise run
    full passes over them repeatedly (measured: restoring 10,000 requests took 6x longer).
    The block is synchronous, so the pause is as long as the work itself.

    ``freeze``: afterwards move every tracked object to the permanent generation
    (``gc.freeze``), so the state just built is not rescanned by the next full collections.
    Tracker state holds no reference cycles; it is freed by reference counting as usual.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if enabled:
            gc.enable()


@dataclass(slots=True)
class Snapshot:
    stream_id: str
    at: int  # wall ns when the state was exported
    origin: int
    seqs: SeqLedger
    trackers: list[dict[str, Any]] = field(default_factory=list)
    early: list[list[Any]] = field(default_factory=list)  # tombstones and pending marks
    selection: dict[str, Any] | None = None  # the selection service's state

    def encode(self) -> bytes:
        blob: bytes = msgpack.packb(
            {
                "format": SNAPSHOT_FORMAT,
                "stream_id": self.stream_id,
                "at": self.at,
                "origin": self.origin,
                "seqs": self.seqs.export(),
                "trackers": self.trackers,
                "early": self.early,
                "selection": self.selection,
            }
        )
        return blob

    @classmethod
    def decode(cls, blob: bytes) -> Snapshot:
        data = msgpack.unpackb(blob, raw=False)
        if not isinstance(data, dict) or data.get("format") != SNAPSHOT_FORMAT:
            raise ValueError("unsupported snapshot format")
        return cls(
            stream_id=data["stream_id"],
            at=data["at"],
            origin=data["origin"],
            seqs=SeqLedger.load(data["seqs"]),
            trackers=data["trackers"],
            early=data.get("early", []),  # absent from snapshots of earlier versions
            selection=data.get("selection"),  # likewise
        )


class SnapshotStore:
    def __init__(self, client: Redis, keys: NamespaceKeys) -> None:
        self.client = client
        self.keys = keys
        self._write = client.register_script(WRITE_SNAPSHOT_SCRIPT)

    async def load(self) -> Snapshot | None:
        blob: Any = await self.client.hget(self.keys.snapshot, "data")
        if blob is None:
            return None
        with gc_paused():
            return Snapshot.decode(blob)

    async def load_readable(self) -> Snapshot | None:
        """The stored snapshot; None when there is none or it cannot be decoded."""
        try:
            return await self.load()
        except IO_ERRORS:
            raise
        except Exception as e:  # a snapshot written by an incompatible version, or garbage
            log.error("ignoring an unreadable snapshot: %r", e)
            return None

    async def meta(self) -> tuple[str, int] | None:
        """``(stream id, taken at wall ns)`` of the stored snapshot, without its data."""
        reply: Any = await self.client.hmget(self.keys.snapshot, ["id", "at"])
        sid, at = reply
        if sid is None or at is None:
            return None
        return sid.decode(), int(at)

    async def reset_pending(self) -> bool:
        """Whether Redis lost data (a reset was detected) and no snapshot was written since."""
        return bool(await self.client.exists(self.keys.reset))

    async def mark_reset(self) -> None:
        """Note a reset: starting instances wait for the next snapshot (``write`` clears it)."""
        await self.client.set(self.keys.reset, "1")

    async def try_lease(self, token: str, ttl_ms: int) -> bool:
        return bool(await self.client.set(self.keys.snapshot_lease, token, nx=True, px=ttl_ms))

    async def cap_lease(self, ttl_ms: int) -> int | None:
        """A lease held by someone else expires within ``ttl_ms`` (every instance sets it for
        one round): if it would not, cut its expiry back to that; returns the ms it had left
        then (-1: no expiry), or None when it was in order."""
        left = int(await self.client.pttl(self.keys.snapshot_lease))
        if left == -1 or left > ttl_ms:
            await self.client.pexpire(self.keys.snapshot_lease, ttl_ms)
            return left
        return None

    async def write(self, snapshot: Snapshot, blob: bytes, lease_token: str = "") -> bool:
        """Store ``blob`` (``snapshot.encode()``); with a token, only while holding the lease."""
        done = await self._write(
            keys=[self.keys.snapshot, self.keys.snapshot_lease, self.keys.reset],
            args=[lease_token, snapshot.stream_id, snapshot.at, snapshot.origin, blob],
        )
        return bool(done)


class SnapshotWriter:
    """The snapshot loop: a round every interval (jittered), writing when it is our turn."""

    def __init__(
        self,
        instance: Instance,
        *,
        schedule: SnapshotSchedule,
        bootstrap: Bootstrap,
        outbox: OwnPosition,
        reader: ReadPosition,
    ) -> None:
        self.me = instance  # who we are, our clocks and counters
        self.counters = instance.counters
        self.schedule = schedule
        self.bootstrap = bootstrap
        self.outbox = outbox
        self.reader = reader
        self.store: SnapshotStore | None = None
        self._target: ReplicatedState | None = None
        # a snapshot the stream's bound asked for, beyond what our reader has read yet
        self.bound_pending: str | None = None

    def connect(self, store: SnapshotStore, target: ReplicatedState) -> None:
        self.store = store
        self._target = target

    async def run(self) -> None:
        interval = self.me.settings.snapshot_interval_seconds
        while True:
            urgent = await self.schedule.next_round(interval * random.uniform(0.8, 1.2))
            honour_cancellation()
            try:
                done = await self._round(interval * 1000, urgent)
            except asyncio.CancelledError:
                raise
            except IO_ERRORS as e:
                log.debug("snapshot round skipped: %s", e)
                done = False
            except Exception:
                log.exception("snapshot round failed")
                done = False
            if urgent and not done:  # e.g. the reader has not checked the stream yet
                await asyncio.sleep(1.0)
                self.schedule.request_now()
            if self.bound_pending is not None:
                await asyncio.sleep(BOUND_RETRY_S)
                self.schedule.request_for_bound(self.bound_pending)
                self.bound_pending = None

    async def _round(self, lease_ms: int, urgent: bool = False) -> bool:
        """Write a snapshot if it is our turn; else note the age of the stored one.

        True when a snapshot exists afterwards that is at most this round old. ``urgent``: also
        write one without the lease while Redis lost data and no snapshot was written since;
        starting instances wait for it, and the lease holder may not be about to write one.
        """
        assert self.store is not None
        self.reader.forget_silent_origins()
        bound_at = self.schedule.take_bound_request()
        if bound_at is not None and parse_id(self.reader.position) < parse_id(bound_at):
            self.bound_pending = bound_at  # not read that far yet: asked again in a moment
            bound_at = None
        if self.allowed():
            token = f"{self.me.instance_id}:{self.me.incarnation}:{random_id()}"
            if await self.store.try_lease(token, lease_ms):
                return await self.write(token)
            await self._check_lease(lease_ms)
            if bound_at is not None and not await self._covered(bound_at):
                # the stream may only be trimmed below the newest snapshot: whoever finds it
                # near its bound writes one, without the lease (held for a whole interval),
                # unless a peer's covers it already
                return await self.write()
        if urgent and await self.store.reset_pending():
            return await self.write()  # False if we cannot: the loop asks again soon
        meta = await self.store.meta()
        if meta is None:
            return False
        self.schedule.note(*meta)
        return True

    async def _check_lease(self, lease_ms: int) -> None:
        """A lease no instance took (longer than a round, or without expiry) would stop
        snapshots: count it (anomaly ``snapshot_lease_held``, degraded), cut it back, log it."""
        assert self.store is not None
        left = await self.store.cap_lease(lease_ms)
        if left is None:
            return
        total = self.counters.anomaly("snapshot_lease_held", self.me.wall_clock())
        log.error(
            "replication anomaly snapshot_lease_held: the snapshot lease %s, longer than a "
            "round (%d ms), which no instance sets; its expiry was cut back to %d ms (%d such "
            "so far)",
            "had no expiry" if left == -1 else f"had {left} ms left",
            lease_ms,
            lease_ms,
            total,
        )

    async def _covered(self, stream_id: str) -> bool:
        """Whether the stored snapshot covers the stream up to ``stream_id``."""
        assert self.store is not None
        meta = await self.store.meta()
        try:
            return meta is not None and parse_id(meta[0]) >= parse_id(stream_id)
        except ValueError:  # not an id: a newer snapshot replaces it
            return False

    def allowed(self) -> bool:
        """Whether our state is worth saving now (``Bootstrap.snapshot_allowed``)."""
        return self.bootstrap.snapshot_allowed(
            bool(self.reader.connected) and not self.reader.catching_up,
            self.reader.applied_seq(self.me.own_key),
        )

    def take(self) -> Snapshot:
        """This instance's state with the stream position and ledger that match it."""
        assert self._target is not None
        seqs = self.reader.ledger_copy()
        last_local = self.outbox.last_accepted_seq
        if last_local > seqs.get(self.me.own_key):
            seqs.advance(self.me.own_key, last_local, self.me.wall_clock())
        return Snapshot(
            self.reader.position,
            self.me.wall_clock(),
            self.me.instance_id,
            seqs,
            self._target.export_state(),
            self._target.export_early(),
            self._target.export_selection(),
        )

    async def write(self, lease_token: str = "") -> bool:
        """Write a snapshot now (unfenced without a token); False if not possible or fenced off."""
        if self.store is None or not self.allowed():
            return False
        started = self.me.clock()
        with gc_paused():
            snapshot = self.take()
            blob = snapshot.encode()
        if not await self.store.write(snapshot, blob, lease_token):
            return False
        self.counters.snapshots_written += 1
        self.schedule.note(snapshot.stream_id, snapshot.at)
        log.info(
            "wrote snapshot at %s: %d trackers, %d bytes, %.0f ms",
            snapshot.stream_id,
            len(snapshot.trackers),
            len(blob),
            (self.me.clock() - started) / NS_PER_MS,
        )
        return True
