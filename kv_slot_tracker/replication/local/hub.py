"""The hub: the ordering point of one host's server processes (``workers`` > 1, no Redis).

It runs in the supervisor (``HubThread``: a thread with an event loop of its own), so a server
process that crashes takes nothing of it down, and it outlives every process: the frames it
sequenced are the host's durable point, as the stream is with Redis.

Every process connects to its Unix socket and says who it is (``HELLO``). Then:

* a ``PUBLISH`` frame (everything the process published since its last one) gets the next
  position of one total order and goes to every process in that order: to the siblings as
  ``DATA`` (the records, forwarded as bytes), to the sender as ``OWN`` (position and last
  sequence number only: its read-back and its acknowledgement);
* a process that says ``HELLO`` gets the state before any frame: while every frame ever
  sequenced is still kept, the empty state at position 0; else the hub asks a ready sibling
  (``EXPORT``), which answers its state at the position it has applied (``STATE``), and
  forwards it (``BEGIN``) followed by the frames after that position (a sibling that ends or
  does not answer within ``export_timeout_s`` is passed over for another);
* ``HEAD?`` is answered with the newest position (the read barrier), once every other process
  connected has sent what it had accepted when asked: the hub sends each a ``FLUSH``, which it
  answers ``FLUSHED`` after writing its outbox, so the frames come first on its connection.
  A position so answered holds every change any process acknowledged before the question (a
  process that ends meanwhile is not waited for: what it had not sent is gone with it), which
  lets a process answer a call for an id the barrier proves unknown as one process would;
* frames are kept (``retained``) from the oldest position not yet applied by every ready
  process (each says what it applied, ``APPLIED`` or inside ``PUBLISH``), at most
  ``max_bytes`` of them; a process whose next frame was dropped by that bound is told to
  ``RESYNC`` and joins again from a sibling's state;
* every ``snapshot_every_s`` the hub takes a process's state for itself (``snapshot``) and keeps
  the frames after it too: when no process holds the state any more (they all ended at once),
  the next to join gets that snapshot and the frames after it. Only when that is gone too
  (the frames after it went past the bound; a fresh one is asked for at once) does a process
  start from the frames kept alone (``lost_joins``, logged as an error).

Each connection is written from the retained frames at its own pace (``pump``): a slow reader
holds back only itself, and what waits for it is bounded by the retained bytes plus one
socket buffer. A frame over ``max_frame_bytes`` is refused and counted; a connection that
ends in the middle of a frame loses only that frame (counted).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from itertools import count
from pathlib import Path
from typing import cast

import msgpack

from kv_slot_tracker.replication.local import framing
from kv_slot_tracker.replication.local.retained import Entry, Retained

log = logging.getLogger(__name__)

RETAINED_BYTES = 64 * 1024 * 1024
JOIN_WAIT_S = 5.0  # with no ready sibling to export a state, a joining process waits this long
JOIN_RETRY_S = 0.2
EXPORT_TIMEOUT_S = 5.0  # a process asked for its state that has not answered by then: ask another
WRITE_HIGH_WATER = 4 * 1024 * 1024  # a connection's socket buffer in the hub, before pausing
STATS_EVERY_S = 1.0  # how often every process is sent the hub's figures (``/replication``)
SNAPSHOT_EVERY_S = 30.0  # how often the hub takes a process's state for itself
MAX_BARRIERS = 10_000  # read barriers waiting for siblings' FLUSHED, at most (oldest dropped)


@dataclass(slots=True)
class HubCounters:
    frames: int = 0  # PUBLISH frames sequenced
    frame_bytes: int = 0
    oversized: int = 0  # frames refused for their size
    cut: int = 0  # connections that ended in the middle of a frame
    refused: int = 0  # frames refused for their kind or place (protocol errors)
    joins: int = 0  # states handed to joining processes
    exports: int = 0  # states asked of a sibling
    resyncs: int = 0  # processes told to load a state again (fell behind the bound)
    lost_joins: int = 0  # joins served without any state (no process, no usable snapshot)
    snapshots: int = 0  # states the hub took from a process for itself
    snapshot_joins: int = 0  # joins served from the hub's own snapshot (no process had a state)
    barriers: int = 0  # read barriers (HEAD?) answered
    barriers_dropped: int = 0  # left unanswered: over MAX_BARRIERS waiting (the asker times out)


@dataclass(eq=False)
class _Export:
    requester: HubConnection
    exporter: HubConnection
    asked_at: float  # monotonic s


@dataclass(eq=False)
class _Pieces:
    """A state arriving in ``STATE+`` frames."""

    sender: HubConnection
    parts: list[bytes] = field(default_factory=list)
    size: int = 0
    refused: bool = False  # over ``MAX_STATE_BYTES``: its pieces are dropped


@dataclass(eq=False)
class _Barrier:
    """A ``HEAD?`` waiting for the other processes' ``FLUSHED``."""

    asker: HubConnection
    token: int  # the asker's
    waiting: set[HubConnection]


class HubConnection(asyncio.Protocol):
    """One process's connection."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self.reader = framing.FrameReader(hub.max_frame_bytes)
        self.transport: asyncio.Transport | None = None
        self.instance_id = 0
        self.incarnation = 0  # 0 until HELLO
        self.synced = False  # has a state and gets every frame from ``cursor`` on
        self.cursor = 0  # the next position to write
        self.applied = 0  # what the process says it applied
        self.paused = False
        self.waiting_since: float | None = None  # monotonic s: joined and waiting for a state
        self.slow_exporter: HubConnection | None = None  # did not answer for this one's state

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)  # uvloop's is not one
        transport.set_write_buffer_limits(high=self.hub.write_high_water)
        self.hub.connections.append(self)

    def data_received(self, data: bytes) -> None:
        before = self.reader.oversized
        frames = self.reader.feed(data)
        if self.reader.oversized != before:
            self.hub.counters.oversized += self.reader.oversized - before
            log.warning("hub: refused a frame over %d bytes", self.reader.max_bytes)
        hub = self.hub
        for frame in frames:
            try:
                hub.handle(self, frame)
            except Exception:  # a bad frame must not take the hub down
                log.exception("hub: dropping the connection of a process sending a bad frame")
                hub.counters.refused += 1
                self.close()
                return
        if frames:
            hub.after_frames()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.reader.pending():
            self.hub.counters.cut += 1
        self.transport = None
        self.hub.gone(self)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self.hub.pump(self)

    def write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class Hub:
    def __init__(
        self,
        path: str | Path,
        *,
        max_retained_bytes: int = RETAINED_BYTES,
        max_frame_bytes: int = framing.MAX_FRAME_BYTES,
        join_wait_s: float = JOIN_WAIT_S,
        export_timeout_s: float = EXPORT_TIMEOUT_S,
        write_high_water: int = WRITE_HIGH_WATER,
        snapshot_every_s: float = SNAPSHOT_EVERY_S,
    ) -> None:
        self.path = str(path)
        self.max_frame_bytes = max_frame_bytes
        self.join_wait_s = join_wait_s
        self.export_timeout_s = export_timeout_s
        self.write_high_water = write_high_water
        self.snapshot_every_s = snapshot_every_s
        self.snapshot: tuple[int, bytes] | None = None  # (position, state) of the hub's own
        self._snapshot_ask: _Export | None = None  # its request in flight (to ``exporter``)
        self._snapshot_token = 0
        self.retained = Retained(max_retained_bytes)
        self.connections: list[HubConnection] = []
        self.counters = HubCounters()
        self._exports: dict[int, _Export] = {}
        self._barriers: dict[int, _Barrier] = {}  # by the hub's token sent in FLUSH
        self._pieces: dict[int, _Pieces] = {}  # states arriving in pieces, by EXPORT token
        self._tokens = count(1)
        self._server: asyncio.AbstractServer | None = None
        self._retry: asyncio.TimerHandle | None = None
        self._stats: asyncio.TimerHandle | None = None
        self._snapshots: asyncio.TimerHandle | None = None

    @property
    def head(self) -> int:
        return self.retained.head

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: HubConnection(self), self.path)
        os.chmod(self.path, 0o600)
        self._stats = loop.call_later(STATS_EVERY_S, self._send_stats)
        self._snapshots = loop.call_later(self.snapshot_every_s, self._take_snapshot)

    async def stop(self) -> None:
        for timer in (self._retry, self._stats, self._snapshots):
            if timer is not None:
                timer.cancel()
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.close()
        if self._server is not None:
            await self._server.wait_closed()

    def stats(self) -> dict[str, int]:
        """The hub's positions and counters, as every process reports them (``hub`` in
        ``GET /replication``)."""
        return {
            "head": self.retained.head,
            "kept_from": self.retained.first,
            "kept_bytes": self.retained.bytes,
            "processes": sum(1 for c in self.connections if c.incarnation),
            "snapshot_position": self.snapshot[0] if self.snapshot else 0,
            "snapshot_bytes": len(self.snapshot[1]) if self.snapshot else 0,
            **asdict(self.counters),
        }

    def _send_stats(self) -> None:
        frame = framing.frame(framing.STATS, msgpack.packb(self.stats()))
        for conn in self.connections:
            if conn.synced:
                conn.write(frame)
        self._stats = asyncio.get_running_loop().call_later(STATS_EVERY_S, self._send_stats)

    # -- the hub's own snapshot ----------------------------------------------------------------

    def _take_snapshot(self) -> None:
        """Every ``snapshot_every_s``: ask the process furthest on for its state, kept here so
        that processes that all ended (or all fell behind) get it back with the frames after it,
        rather than only the frames kept."""
        loop = asyncio.get_running_loop()
        self._snapshots = loop.call_later(self.snapshot_every_s, self._take_snapshot)
        if self.snapshot is None or self.snapshot[0] < self.retained.head:  # else: nothing new
            self._ask_snapshot()

    def _ask_snapshot(self) -> None:
        ask = self._snapshot_ask
        if ask is not None and time.monotonic() - ask.asked_at < self.export_timeout_s:
            return  # one at a time
        synced = [c for c in self.connections if c.synced]
        if not synced:
            return
        exporter = max(synced, key=lambda c: c.applied)
        self._snapshot_token = token = next(self._tokens)
        self._snapshot_ask = _Export(exporter, exporter, time.monotonic())
        exporter.write(framing.frame_u64(framing.EXPORT, token))

    def _snapshot_usable(self) -> bool:
        """The frames after the snapshot are all kept (else it is of no use)."""
        return self.snapshot is not None and self.snapshot[0] + 1 >= self.retained.first

    # -- frames in ----------------------------------------------------------------------------

    def handle(self, conn: HubConnection, frame: bytes) -> None:
        kind = frame[:1]
        if kind == framing.PUBLISH and conn.incarnation:
            last_seq, applied = framing.U64_2.unpack_from(frame, 1)
            records = memoryview(frame)[17:]
            position = self.retained.head + 1
            data = framing.frame_u64(framing.DATA, position, tail=bytes(records))
            self.retained.append(Entry(conn.incarnation, last_seq, data))
            self.counters.frames += 1
            self.counters.frame_bytes += len(records)
            if applied > conn.applied:
                conn.applied = applied
        elif kind == framing.APPLIED and conn.incarnation:
            (applied,) = framing.U64.unpack_from(frame, 1)
            if applied > conn.applied:
                conn.applied = applied
        elif kind == framing.HEAD_ASK and conn.incarnation:
            (token,) = framing.U64.unpack_from(frame, 1)
            self._barrier(conn, token)
        elif kind == framing.FLUSHED and conn.incarnation:
            (ours,) = framing.U64.unpack_from(frame, 1)
            barrier = self._barriers.get(ours)
            if barrier is not None:
                barrier.waiting.discard(conn)
                if not barrier.waiting:
                    self._answer_barrier(ours)
        elif kind == framing.STATE_PART and conn.incarnation:
            (token,) = framing.U64.unpack_from(frame, 1)
            self._piece(conn, token, memoryview(frame)[9:])
        elif kind == framing.STATE and conn.incarnation:
            token, position = framing.U64_2.unpack_from(frame, 1)
            state = memoryview(frame)[17:]
            pieces = self._pieces.pop(token, None)
            if pieces is not None:
                if pieces.refused:
                    return
                state = memoryview(b"".join([*pieces.parts, state]))
            if token == self._snapshot_token:
                self._snapshot_ask, self._snapshot_token = None, 0
                if position + 1 >= self.retained.first:
                    self.snapshot = (position, bytes(state))
                    self.counters.snapshots += 1
            else:
                self._exported(conn, token, position, state)
        elif kind == framing.HELLO and not conn.incarnation:
            conn.instance_id, conn.incarnation = framing.U64_2.unpack_from(frame, 1)
            if not conn.incarnation:
                raise ValueError("HELLO with incarnation 0")
            self._join(conn)
        else:
            raise ValueError(f"unexpected frame kind {kind!r}")

    def _piece(self, conn: HubConnection, token: int, piece: memoryview) -> None:
        """A piece of a large state (``STATE+``), kept until its ``STATE``."""
        pieces = self._pieces.get(token)
        if pieces is None:
            pieces = self._pieces[token] = _Pieces(conn)
        if pieces.refused:
            return
        pieces.size += len(piece)
        if pieces.size > framing.MAX_STATE_BYTES:  # dropped; the join asks another sibling
            log.error("hub: refused a state of process %d over %d bytes", conn.instance_id,
                      framing.MAX_STATE_BYTES)  # fmt: skip
            self.counters.oversized += 1
            pieces.refused, pieces.parts = True, []
            return
        pieces.parts.append(bytes(piece))

    # -- the read barrier -----------------------------------------------------------------------

    def _barrier(self, asker: HubConnection, token: int) -> None:
        """``HEAD?``: the head once every other process has sent what it accepted (FLUSH)."""
        others = {c for c in self.connections if c is not asker and c.incarnation}
        ours = next(self._tokens)
        self._barriers[ours] = _Barrier(asker, token, others)
        if not others:
            self._answer_barrier(ours)
            return
        flush = framing.frame_u64(framing.FLUSH, ours)
        for conn in others:
            conn.write(flush)
        if len(self._barriers) > MAX_BARRIERS:  # siblings not answering: forget the oldest
            del self._barriers[next(iter(self._barriers))]
            self.counters.barriers_dropped += 1

    def _answer_barrier(self, ours: int) -> None:
        barrier = self._barriers.pop(ours)
        self.counters.barriers += 1
        barrier.asker.write(framing.frame_u64(framing.HEAD, barrier.token, self.retained.head))

    def after_frames(self) -> None:
        """After a read's frames: write what is new, then trim (after: a process keeping up
        is sent every frame before the bound may drop one)."""
        for conn in self.connections:
            if conn.synced:
                self.pump(conn)
        self._trim()

    # -- frames out ---------------------------------------------------------------------------

    def pump(self, conn: HubConnection) -> None:
        """Write ``conn`` the frames from its cursor to the head (until its buffer is full)."""
        if not conn.synced or conn.paused or conn.transport is None:
            return
        retained, head, position = self.retained, self.retained.head, conn.cursor
        if position > head:
            return
        own = conn.incarnation
        chunks = []
        while position <= head:
            entry = retained.get(position)
            if entry.sender == own:
                chunks.append(framing.frame_u64(framing.OWN, position, entry.last_seq))
            else:
                chunks.append(entry.data)
            position += 1
        conn.cursor = position
        conn.transport.write(b"".join(chunks))

    def _trim(self) -> None:
        retained = self.retained
        synced = [c.applied for c in self.connections if c.synced]
        if synced:
            floor = min(synced)
            if self.snapshot is not None:  # the frames after it too
                floor = min(floor, self.snapshot[0])
            retained.trim_through(floor)
        if retained.over_bound():
            retained.trim_to_bound()
            if self.snapshot is not None and not self._snapshot_usable():
                self.snapshot = None  # frames after it dropped: a fresh one, now
                self._ask_snapshot()
            for conn in self.connections:
                if conn.synced and conn.cursor < retained.first:
                    log.warning(
                        "hub: process %d fell behind the %d bytes of frames kept; it loads a "
                        "sibling's state again",
                        conn.instance_id,
                        retained.max_bytes,
                    )
                    self.counters.resyncs += 1
                    conn.write(framing.frame(framing.RESYNC))
                    self._join(conn)

    # -- joining: the state, then the frames after it -------------------------------------------

    def _join(self, conn: HubConnection) -> None:
        conn.synced = False
        conn.waiting_since = time.monotonic()
        self._serve_joins()

    def _serve_joins(self) -> None:
        if self._retry is not None:  # called before the timer: one timer at a time
            self._retry.cancel()
            self._retry = None
        now = time.monotonic()
        for token, export in list(self._exports.items()):
            if now - export.asked_at >= self.export_timeout_s:
                log.warning("hub: process %d did not send its state within %.0f s; asking "
                            "another", export.exporter.instance_id, self.export_timeout_s)  # fmt: skip
                export.requester.slow_exporter = export.exporter
                del self._exports[token]
        asked = {e.requester for e in self._exports.values()}
        for conn in self.connections:
            if conn.waiting_since is None or conn in asked:
                continue
            if self.retained.first == 1:  # every frame is still here: replay them all
                self._begin(conn, 0, b"")
                continue
            siblings = [c for c in self.connections if c.synced and c is not conn]
            if not siblings and self.snapshot is not None and self._snapshot_usable():
                position, state = self.snapshot  # every process ended: the hub's own copy
                log.warning("hub: no process holds the state; process %d loads the hub's "
                            "snapshot at position %d", conn.instance_id, position)  # fmt: skip
                self.counters.snapshot_joins += 1
                self._begin(conn, position, state)
                continue
            if len(siblings) > 1 and conn.slow_exporter in siblings:
                siblings.remove(conn.slow_exporter)
            if siblings:
                exporter = max(siblings, key=lambda c: c.applied)
                token = next(self._tokens)
                self._exports[token] = _Export(conn, exporter, now)
                self.counters.exports += 1
                exporter.write(framing.frame_u64(framing.EXPORT, token))
            elif now - conn.waiting_since >= self.join_wait_s:
                log.error(
                    "hub: no process holds the state to give process %d; it starts from the "
                    "frames kept since position %d (earlier changes are lost)",
                    conn.instance_id,
                    self.retained.first,
                )
                self.counters.lost_joins += 1
                self._begin(conn, self.retained.first - 1, b"")
        # while a state is awaited or asked for, look again shortly (timeouts, no sibling yet)
        waiting = any(c.waiting_since is not None for c in self.connections)
        if (waiting or self._exports) and self._retry is None:
            self._retry = asyncio.get_running_loop().call_later(JOIN_RETRY_S, self._serve_joins)

    def _exported(
        self, exporter: HubConnection, token: int, position: int, state: memoryview
    ) -> None:
        export = self._exports.pop(token, None)
        if export is None or export.requester.waiting_since is None:
            return  # the requester is gone, or was served otherwise
        if position + 1 < self.retained.first or position > self.retained.head:
            self._serve_joins()  # the frames after it are gone meanwhile: ask again
            return
        self._begin(export.requester, position, bytes(state))

    def _begin(self, conn: HubConnection, position: int, state: bytes) -> None:
        for frame in framing.state_frames(
            framing.BEGIN_PART, framing.BEGIN, state, (), (position,)
        ):
            conn.write(frame)
        conn.waiting_since = None
        conn.slow_exporter = None
        conn.synced = True
        conn.cursor = position + 1
        conn.applied = max(position, self.retained.first - 1)
        self.counters.joins += 1
        self.pump(conn)
        # a process that joined can export to the next ones
        if any(c.waiting_since is not None for c in self.connections):
            self._serve_joins()

    def gone(self, conn: HubConnection) -> None:
        with contextlib.suppress(ValueError):
            self.connections.remove(conn)
        conn.synced = False
        conn.waiting_since = None
        for token, export in list(self._exports.items()):
            if conn in (export.requester, export.exporter):  # an exporter gone: ask another
                del self._exports[token]
        if self._snapshot_ask is not None and self._snapshot_ask.exporter is conn:
            self._snapshot_ask, self._snapshot_token = None, 0
        for token in [t for t, p in self._pieces.items() if p.sender is conn]:
            del self._pieces[token]
        for ours, barrier in list(self._barriers.items()):
            if barrier.asker is conn:
                del self._barriers[ours]
            elif conn in barrier.waiting:  # what it had not sent is gone with it
                barrier.waiting.discard(conn)
                if not barrier.waiting:
                    self._answer_barrier(ours)
        if any(c.waiting_since is not None for c in self.connections):
            self._serve_joins()
        self._trim()


@dataclass
class HubThread:
    """The hub on a thread of the supervisor, with an event loop of its own."""

    path: Path
    max_retained_bytes: int = RETAINED_BYTES
    snapshot_every_s: float = SNAPSHOT_EVERY_S
    hub: Hub | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _started: threading.Event = field(default_factory=threading.Event)
    _error: BaseException | None = None

    def start(self, timeout_s: float = 10.0) -> None:
        self._thread = threading.Thread(target=self._run, name="supervisor-hub", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout_s) or self._error is not None:
            raise RuntimeError(f"the supervisor's hub did not start: {self._error}")
        log.info("supervisor's hub at %s", self.path)

    def _run(self) -> None:
        loop = self._loop = _new_loop()
        asyncio.set_event_loop(loop)
        self.hub = Hub(
            self.path,
            max_retained_bytes=self.max_retained_bytes,
            snapshot_every_s=self.snapshot_every_s,
        )
        try:
            loop.run_until_complete(self.hub.start())
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self._error = e
            self._started.set()
            return
        self._started.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self.hub.stop())
            loop.close()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            loop.call_soon_threadsafe(loop.stop)
            thread.join(5.0)


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop when installed, as the server processes use (a few microseconds less per
    frame than asyncio's), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
