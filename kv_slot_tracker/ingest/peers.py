"""Peer recovery of the KV-event index (Dynamo's ``--indexer-peers``).

KV events are not replicated through Redis: every instance listens to the engines itself. An
instance that starts late, or again, has missed what the engines published before; an engine's
replay socket (when it has one) may fill the gap, else the rank is cleared at its first batch.
With ``indexer_peers`` it loads the index from another instance first.

The dump (``dump_lines``, served as ``GET /selection/kv_index``) is NDJSON, streamed one
partition at a time (the server holds one partition's blocks as plain tuples while it sends
them):

* ``{"kind": "header", "format": 1}``;
* per partition ``{"kind": "partition", "model_name", "routing_group", "block_size"}``, then its
  ranks ``{"kind": "rank", "worker_id", "dp_rank", "seq", "blocks": [[tier, block_hash,
  parent_hash or null, tokens_hash], ...]}`` (hashes as u64, converted from and to the
  service's signed form here), a rank's blocks split over lines of at most
  ``CHUNK_BLOCKS`` (each line repeats the rank). ``seq`` is the last batch the rank's listener
  applied (null: none); it is read in the same step as the partition's blocks, so they agree;
* ``{"kind": "end", "ranks": n, "blocks": n}``.

The loader (``IndexPeers.run``) waits for the shared state (the worker catalog says which
partitions and workers exist here), then asks each peer in turn, again and again, until one gives
its whole dump or ``indexer_peers_timeout_seconds`` have passed. A dump is used only once its end
line has arrived (a dump broken off is not used at all). Each worker's ranks are then loaded, in
one synchronous step, as the worker's first listener is created here, and each listener starts
from its rank's ``seq``: the next batch continues the index, a later one is a gap (replayed, or
the rank cleared) like any other. With no peer answering, the listeners start with no sequence
number and it is logged.

A peer is a trust boundary. Bounded: ``MAX_DUMP_BYTES`` in all, ``MAX_LINE_BYTES`` a line. A line
that does not decode, or an entry out of range, is counted and skipped, and its partition's
sequence numbers are not used (those ranks resynchronise from the engines at their first batch);
a partition unknown here (or of another block size) and a worker not schedulable here are skipped
and counted. Nothing a peer sends is fatal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, fields
from typing import Any

import h11
import msgspec
import orjson

from kv_slot_tracker.core.bounds import I64_MIN, U32_MAX, U64_MAX
from kv_slot_tracker.core.hashing import to_signed, to_unsigned
from kv_slot_tracker.core.selection.kv_blocks import TIERS
from kv_slot_tracker.core.types import WorkerWithDpRank

from .port import KvIndexHost, PartitionKey, RankKey
from .zmq import ZmqIngest

log = logging.getLogger(__name__)

FORMAT = 1
DUMP_PATH = "/selection/kv_index"
MEDIA_TYPE = "application/x-ndjson"
CHUNK_BLOCKS = 20_000
MAX_LINE_BYTES = 4 << 20
MAX_DUMP_BYTES = 512 << 20
HEAD_MAX_BYTES = 64 << 10  # the status line and headers of a peer's answer
RETRY_PAUSE_S = 0.5
PENDING_TTL_S = 60

Entry = tuple[int, int, int | None, int]


class PeerError(Exception):
    """A peer that did not give a whole, well-formed dump; the text says why."""


# -- the dump (served) -----------------------------------------------------------------------------


def _line(obj: dict[str, Any]) -> bytes:
    return orjson.dumps(obj) + b"\n"


async def dump_lines(host: KvIndexHost, ingest: ZmqIngest | None) -> AsyncIterator[bytes]:
    """This instance's index as the NDJSON lines above: each partition's blocks and its ranks'
    sequence numbers are read together in one step, then sent line by line."""
    yield _line({"kind": "header", "format": FORMAT})
    ranks_sent = blocks_sent = 0
    partitions = host.kv_partitions()
    for key in sorted(partitions):
        part = partitions[key]
        yield _line(
            {"kind": "partition", "model_name": key[0], "routing_group": key[1],
             "block_size": part.block_size}
        )  # fmt: skip
        by_rank = part.index.entries_by_rank()  # this and the seqs below in one step
        for w, rs in part.ranks.items():
            for r in rs:
                by_rank.setdefault(WorkerWithDpRank(w, r), [])
        seqs = {
            rank: None if ingest is None else ingest.watermark((rank.worker_id, rank.dp_rank))
            for rank in by_rank
        }
        for rank in sorted(by_rank):
            entries, seq = by_rank.pop(rank), seqs[rank]
            if not entries and seq is None:
                continue
            ranks_sent += 1
            blocks_sent += len(entries)
            for i in range(0, max(len(entries), 1), CHUNK_BLOCKS):
                yield _line(
                    {"kind": "rank", "worker_id": rank.worker_id, "dp_rank": rank.dp_rank,
                     "seq": seq, "blocks": _u64_entries(entries[i : i + CHUNK_BLOCKS])}
                )  # fmt: skip
    yield _line({"kind": "end", "ranks": ranks_sent, "blocks": blocks_sent})


# -- the loader ------------------------------------------------------------------------------------


class _Header(msgspec.Struct, tag_field="kind", tag="header"):
    format: int


class _Partition(msgspec.Struct, tag_field="kind", tag="partition"):
    model_name: str
    routing_group: str
    block_size: int


class _Rank(msgspec.Struct, tag_field="kind", tag="rank"):
    worker_id: int
    dp_rank: int
    seq: int | None
    blocks: list[tuple[int, int, int | None, int]]


class _End(msgspec.Struct, tag_field="kind", tag="end"):
    ranks: int
    blocks: int


_decode = msgspec.json.Decoder(_Header | _Partition | _Rank | _End).decode


@dataclass(slots=True)
class RecoveryCounters:
    """What peer recovery did (totals since start; read by the metrics and /selection/ready)."""

    peer_failures: int = 0
    """Attempts on a peer that gave no whole dump (unreachable, an error status, broken off)."""
    ranks: int = 0
    """Ranks loaded."""
    ranks_skipped: int = 0
    """Ranks not loaded: their worker is in another partition (or block size) here, or did not
    become schedulable here within ``PENDING_TTL_S``."""
    blocks: int = 0
    """Blocks loaded."""
    blocks_refused: int = 0
    """Blocks the index could not place (parent never given, repeated hash)."""
    malformed: int = 0
    """Lines that did not decode and entries out of range, skipped."""

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(slots=True)
class _PartitionDump:
    key: PartitionKey
    block_size: int
    ranks: dict[RankKey, tuple[int | None, list[Entry]]] = field(default_factory=dict)
    tainted: bool = False


@dataclass(slots=True)
class _WorkerDump:
    """One worker's ranks of a dump, waiting for the worker's first listener here."""

    key: PartitionKey
    block_size: int
    ranks: dict[int, tuple[int | None, list[Entry]]]
    tainted: bool


class IndexPeers:
    """This instance's side of index sharing: serves its index (``dump``), and at start loads
    the index from the first of ``peers`` that gives it (``run``).

    A fetched dump is kept per worker and loaded into the index as the worker's first listener
    is created here (``seed_for``, the ingest's ``seed``), in the same step that gives the
    listener its starting sequence number. At start that is at once for every worker the shared
    state lists (the listeners start before ``/selection/ready`` says ready); a worker registered
    later (an instance without Redis learns its workers after start) gets its ranks then, within
    ``PENDING_TTL_S``. A dump older than its engine's next batch is safe: the batch is a gap.
    """

    def __init__(
        self,
        host: KvIndexHost,
        ingest: ZmqIngest,
        peers: list[str],
        *,
        api_key: str = "",
        timeout_s: float = 10.0,
        max_dump_bytes: int = MAX_DUMP_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.host, self.ingest, self.peers = host, ingest, peers
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.max_dump_bytes = max_dump_bytes
        self.clock = clock
        self.counters = RecoveryCounters()
        self.recovering = bool(peers)
        """True until the start-up recovery is over (loaded, or no peer answered in time)."""
        self.recovered_from: str | None = None
        self._pending: dict[int, _WorkerDump] = {}
        self._seeds: dict[RankKey, int] = {}  # loaded ranks whose listener is not created yet
        self._pending_until = 0.0
        ingest.seed = self.seed_for

    def dump(self) -> AsyncIterator[bytes]:
        return dump_lines(self.host, self.ingest)

    def status(self, silent_seconds: float) -> dict[str, Any]:
        """For ``/selection/ready``: the recovery, and the publishers as the listeners see them."""
        return {
            "recovering": self.recovering,
            "peers": list(self.peers),
            "recovered_from": self.recovered_from,
            "listening_ranks": len(self.ingest.listeners),
            "disconnected_ranks": self.ingest.disconnected(),
            "silent_ranks": self.ingest.silent(silent_seconds),
        }

    async def run(self, shared_state_ready: Callable[[], bool]) -> None:
        """Recover (bounded by ``timeout_s`` in all), then start the listeners; never raises."""
        try:
            if self.peers:
                await self._recover(shared_state_ready)
                await self.ingest.reconcile()  # the known workers' listeners, and their ranks
        except Exception:  # a bug here must not keep the instance from its engines
            log.exception("KV index recovery failed; starting from the engines alone")
        finally:
            self.recovering = False
        self.ingest.start()

    async def _recover(self, shared_state_ready: Callable[[], bool]) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while not shared_state_ready() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        while True:
            for peer in self.peers:
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    async with asyncio.timeout(left):
                        dump = await self._fetch(peer)
                except (PeerError, OSError, EOFError, TimeoutError, ValueError) as e:
                    self.counters.peer_failures += 1
                    log.warning(
                        "KV index recovery: peer %s gave no index (%s); trying the next",
                        peer, str(e) or type(e).__name__,
                    )  # fmt: skip
                    continue
                self._keep(dump, peer)
                return
            if loop.time() + RETRY_PAUSE_S >= deadline:
                break
            await asyncio.sleep(RETRY_PAUSE_S)
        log.warning(
            "KV index recovery: no peer of %s gave its index within %.1f s; starting from the "
            "engines alone (a rank whose engine has a replay endpoint replays from sequence 0 at "
            "its first batch, any other rank is cleared there and holds only what comes next)",
            ", ".join(self.peers), self.timeout_s,
        )  # fmt: skip

    async def _fetch(self, peer: str) -> list[_PartitionDump]:
        out: list[_PartitionDump] = []
        header = ended = False
        async for raw in _get_lines(peer + DUMP_PATH, self._headers(), self.max_dump_bytes):
            if ended:
                raise PeerError("lines after the end line")
            try:
                msg = _decode(raw)
            except msgspec.DecodeError as e:
                if not header:
                    raise PeerError(f"not a KV index dump: {e}") from None
                self._malformed(out, f"line skipped: {e}")
                continue
            if isinstance(msg, _Header):
                if header or msg.format != FORMAT:
                    raise PeerError(f"unexpected header (format {msg.format})")
                header = True
            elif not header:
                raise PeerError("the dump does not start with its header")
            elif isinstance(msg, _Partition):
                if not 0 < msg.block_size <= U32_MAX:
                    self._malformed(out, f"block_size {msg.block_size} out of range")
                    out.append(_PartitionDump((msg.model_name, msg.routing_group), 0, tainted=True))
                    continue
                out.append(_PartitionDump((msg.model_name, msg.routing_group), msg.block_size))
            elif isinstance(msg, _Rank):
                self._rank(out, msg)
            else:
                ended = True
        if not ended:
            raise PeerError("the dump broke off before its end line")
        return out

    def _rank(self, out: list[_PartitionDump], msg: _Rank) -> None:
        if not out:
            self.counters.malformed += 1
            log.warning("KV index recovery: a rank before any partition skipped")
            return
        part = out[-1]
        if not (0 <= msg.worker_id <= U64_MAX and 0 <= msg.dp_rank <= U32_MAX) or not (
            msg.seq is None or 0 <= msg.seq <= U64_MAX
        ):
            self._malformed(out, f"rank {msg.worker_id}:{msg.dp_rank} out of range")
            return
        good = [_signed_entry(e) for e in msg.blocks if _valid(e)]
        if len(good) != len(msg.blocks):
            self._malformed(
                out, f"{len(msg.blocks) - len(good)} entries of {msg.worker_id}:{msg.dp_rank}"
            )
            self.counters.malformed += len(msg.blocks) - len(good) - 1
        key = (msg.worker_id, msg.dp_rank)
        have = part.ranks.get(key)
        if have is None:
            part.ranks[key] = (msg.seq, good)
        else:
            if have[0] != msg.seq:
                self._malformed(out, f"rank {key} given with two sequence numbers")
            have[1].extend(good)

    def _malformed(self, out: list[_PartitionDump], why: str) -> None:
        self.counters.malformed += 1
        if out:
            out[-1].tainted = True
        if self.counters.malformed <= 10:
            log.warning("KV index recovery: malformed dump part skipped: %s", why)

    def _keep(self, dump: list[_PartitionDump], peer: str) -> None:
        """Hold ``dump`` per worker until the worker's first listener here (``seed_for``)."""
        pending: dict[int, _WorkerDump] = {}
        blocks = 0
        for part in dump:
            for (wid, r), rank in part.ranks.items():
                have = pending.get(wid)
                if have is None or (have.key, have.block_size) != (part.key, part.block_size):
                    have = pending[wid] = _WorkerDump(part.key, part.block_size, {}, part.tainted)
                have.ranks[r] = rank
                blocks += len(rank[1])
        self._pending = pending
        self._pending_until = self.clock() + PENDING_TTL_S
        self.recovered_from = peer
        log.info(
            "KV index recovered from %s: %d workers, %d ranks, %d blocks (%d malformed parts "
            "skipped); each worker's ranks are loaded as it is listened to here",
            peer, len(pending), sum(len(w.ranks) for w in pending.values()), blocks,
            self.counters.malformed,
        )  # fmt: skip

    def seed_for(self, key: RankKey) -> int | None:
        """The starting sequence number of ``key``'s new listener; first loads the recovered
        ranks of its worker into its partition's index (once). Never raises."""
        try:
            return self._seed_for(key)
        except Exception:
            log.exception("KV index recovery: loading worker %d failed", key[0])
            return None

    def _seed_for(self, key: RankKey) -> int | None:
        if not self._pending and not self._seeds:
            return None
        c = self.counters
        if self.clock() > self._pending_until:  # too old: its sequence numbers could mislead
            left = sum(len(w.ranks) for w in self._pending.values())
            c.ranks_skipped += left
            log.warning(
                "KV index recovery: %d recovered ranks dropped: their workers did not become "
                "schedulable here within %d s", left, PENDING_TTL_S,
            )  # fmt: skip
            self._pending.clear()
            self._seeds.clear()
            return None
        if key in self._seeds:
            return self._seeds.pop(key)
        wid, r = key
        worker = self._pending.pop(wid, None)
        if worker is None:
            return None
        local = self.host.kv_partitions().get(worker.key)
        if local is None or local.block_size != worker.block_size or wid not in local.ranks:
            c.ranks_skipped += len(worker.ranks)
            log.warning(
                "KV index recovery: worker %d skipped: the peer had it in model=%s "
                "routing_group=%s block_size=%d, not so here", wid, *worker.key, worker.block_size,
            )  # fmt: skip
            return None
        seeds: dict[int, int] = {}
        for dp_rank, (seq, entries) in worker.ranks.items():
            rank = WorkerWithDpRank(wid, dp_rank)
            local.index.clear_rank(rank)
            refused = local.index.load_rank(rank, entries)
            c.ranks += 1
            c.blocks += len(entries) - refused
            c.blocks_refused += refused
            if seq is not None and not refused and not worker.tainted:
                seeds[dp_rank] = seq
        for dp_rank, seq in seeds.items():  # the worker's other ranks' listeners come next
            if dp_rank != r:
                self._seeds[wid, dp_rank] = seq
        return seeds.get(r)

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def _valid(e: Entry) -> bool:
    tier, h, parent, local = e
    return (
        tier in TIERS
        and I64_MIN <= h <= U64_MAX
        and (parent is None or I64_MIN <= parent <= U64_MAX)
        and 0 <= local <= U64_MAX
    )


def _u64_entries(entries: list[Entry]) -> list[Entry]:
    """Index entries (signed hashes) as a dump line carries them (u64)."""
    u = to_unsigned
    return [
        (tier, u(h), None if parent is None else u(parent), u(local))
        for tier, h, parent, local in entries
    ]


def _signed_entry(e: Entry) -> Entry:
    """A dump line's entry (u64, or signed) with the service's signed hashes."""
    tier, h, parent, local = e
    return tier, to_signed(h), None if parent is None else to_signed(parent), to_signed(local)


# -- GET over HTTP/1.1 (h11 parses; the service carries no HTTP client) ------------------------


async def _get_lines(url: str, headers: dict[str, str], max_bytes: int) -> AsyncIterator[bytes]:
    """The body of ``GET url`` line by line (200 only), at most ``max_bytes`` in all and
    ``MAX_LINE_BYTES`` a line; ``PeerError`` otherwise."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise PeerError(f"not an http(s) URL: {url!r}")
    tls = ssl.create_default_context() if parts.scheme == "https" else None
    port = parts.port or (443 if tls else 80)
    reader, writer = await asyncio.open_connection(parts.hostname, port, ssl=tls)
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=HEAD_MAX_BYTES)
    try:
        request = h11.Request(
            method="GET",
            target=parts.path or "/",
            headers=[("Host", parts.netloc), ("Connection", "close"), ("Accept", MEDIA_TYPE),
                     *headers.items()],
        )  # fmt: skip
        writer.write(conn.send(request) + conn.send(h11.EndOfMessage()))
        await writer.drain()
        events = _events(conn, reader)
        head = await anext(events)
        if not isinstance(head, h11.Response):
            raise PeerError("not an HTTP/1.1 answer")
        if head.status_code != 200:
            detail = b""
            async for event in events:
                if isinstance(event, h11.Data) and len(detail) < 512:
                    detail += event.data
            text = detail[:512].decode("utf-8", "replace").strip()
            raise PeerError(f"answered {head.status_code} {text}".strip())
        pieces: list[bytes] = []  # of the line not complete yet
        held = total = 0
        async for event in events:
            if not isinstance(event, h11.Data):
                continue
            data = bytes(event.data)
            total += len(data)
            if total > max_bytes:
                raise PeerError(f"the dump exceeds {max_bytes} bytes")
            if b"\n" in data:
                *complete, rest = b"".join((*pieces, data)).split(b"\n")
                pieces, held = [rest], len(rest)
                for line in complete:
                    if len(line) > MAX_LINE_BYTES:
                        raise PeerError(f"a line exceeds {MAX_LINE_BYTES} bytes")
                    if line.strip():
                        yield line
            else:
                pieces.append(data)
                held += len(data)
            if held > MAX_LINE_BYTES:
                raise PeerError(f"a line exceeds {MAX_LINE_BYTES} bytes")
        rest = b"".join(pieces)
        if rest.strip():
            yield rest
    except h11.ProtocolError as exc:
        raise PeerError(f"not a valid HTTP/1.1 answer: {exc}") from None
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def _events(conn: h11.Connection, reader: asyncio.StreamReader) -> AsyncIterator[Any]:
    """The answer's h11 events, up to its end (a connection closed early is a ProtocolError)."""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await reader.read(1 << 16))
            continue
        if isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
            return
        yield event
