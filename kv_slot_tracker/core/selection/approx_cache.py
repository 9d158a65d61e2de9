"""The approximate cache: which prompt prefixes were recently routed to which rank (one partition).

Why it exists: with KV events off the reference cannot see the workers' caches, so it remembers
what it booked (SELECTION.md §7). Every booking that carries ``block_hashes`` writes the chain on
the booked rank; each block expires ``router_ttl_secs`` after its last write (re-booking a prefix
refreshes exactly those blocks). A later prompt's overlap on a rank is the number of its leading
blocks the rank holds, consecutive from block 0.

Blocks are keyed by the chained hash of the block hashes (``chained_hashes``: the reference's
``compute_seq_hash_for_block``), so a block stands for its whole prefix: the same block hashes
match whatever the request's own sequence hashes are, and a prompt differing in block 0 matches
nothing. These keys are what ``/dump`` shows as ``block_hash``. Hashes are in the service's
signed form (``kv_slot_tracker.core.hashing``); ``export`` and ``restore`` carry them as u64, the
snapshot's form.

Cost: a lookup first sweeps what has expired, then walks the prompt's chain of nodes; it touches
only ranks holding the prompt's blocks, never ranks that do not match, and compares rank sets
only at the depths where some rank stops matching; ``lookup_probes`` counts that work to make it
testable. Expiry uses a heap with one entry per write (all blocks of a write expire together);
``expire(now)`` pops it, so its cost is proportional to what expires (plus blocks of stale
entries left by refreshes, each paid for by the write that made it stale; the heap is rebuilt
when those outnumber the live blocks). Reads that do not sweep (``blocks``, ``stored_runs``) skip expired entries. Time is
integer nanoseconds passed in by the caller.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..hashing import chained_hashes, to_signed, to_unsigned
from ..types import WorkerWithDpRank

# A heap larger than this multiple of the live entries (plus slack) is rebuilt without its stale
# entries; the rebuild is paid for by the refreshing writes that made those entries stale.
_HEAP_REBUILD_FACTOR = 2
_HEAP_REBUILD_SLACK = 1024


@dataclass(frozen=True, slots=True)
class CachedBlock:
    """One live block of one rank, as ``/dump`` lists it."""

    worker: WorkerWithDpRank
    block_hash: int
    """Chained hash of the block hashes up to and including this block (signed)."""
    parent_hash: int | None
    """The previous block's chained hash; ``None`` for block 0."""
    tokens_hash: int
    """The block's own (local) block hash (signed)."""
    expires_at_ns: int


@dataclass(frozen=True, slots=True)
class StoredRun:
    """Consecutive blocks of one rank, as one ``stored`` event of ``/dump``."""

    worker: WorkerWithDpRank
    parent_hash: int | None
    blocks: tuple[tuple[int, int], ...]
    """``(block_hash, tokens_hash)`` per block: the chained key and the local block hash."""
    storage_tier: str = "device"
    """``/dump``'s tier (the KV-event index also lists host_pinned and disk blocks)."""


class _Node:
    """A chain key: its parent and local hash, and the ranks holding it with their expiry."""

    __slots__ = ("parent", "local", "ranks")

    def __init__(self, parent: int | None, local: int) -> None:
        self.parent = parent
        self.local = local
        self.ranks: dict[WorkerWithDpRank, int] = {}


class ApproximateCache:
    """Block-hash chains per rank of one partition, with per-block TTL."""

    def __init__(self, ttl_ns: int) -> None:
        if ttl_ns < 0:
            raise ValueError("ttl_ns must be >= 0")
        self.ttl_ns = ttl_ns
        self._nodes: dict[int, _Node] = {}
        # rank -> its chain keys (dict as an ordered set). A block is written with its parent and
        # never outlives it (the parent's last write is at least as late), so parents come first.
        self._by_rank: dict[WorkerWithDpRank, dict[int, None]] = {}
        self._ranks_of_worker: dict[int, set[WorkerWithDpRank]] = {}
        # One entry per write: (expires_at, write number, rank, its chain keys). All blocks of a
        # write share one expiry, so a write costs one push however long the prompt is.
        self._heap: list[tuple[int, int, WorkerWithDpRank, tuple[int, ...]]] = []
        self._heap_keys = 0  # keys held by heap entries, stale ones included
        self._writes = 0
        self._live = 0
        self.lookup_probes = 0
        """Work done by ``overlaps``: path nodes visited plus ranks handed out or compared
        (a cost counter, never reset)."""

    # -- writes ------------------------------------------------------------------------------------

    def record(
        self,
        worker: WorkerWithDpRank,
        block_hashes: Sequence[int],
        now_ns: int,
        *,
        chain: Sequence[int] | None = None,
    ) -> None:
        """A booking of ``block_hashes`` on ``worker`` at ``now_ns``: (re)write every block.

        Hashes are signed (the service's form). ``chain`` may pass the chained keys when the
        caller already has them (for a token prompt they equal its sequence hashes); it must
        then equal ``chain_keys(block_hashes)``.
        """
        if not block_hashes:
            return
        keys = chain if chain is not None else chained_hashes(block_hashes)
        expires = now_ns + self.ttl_ns
        nodes = self._nodes
        rank_keys = self._by_rank.get(worker)
        if rank_keys is None:
            rank_keys = self._by_rank[worker] = {}
            self._ranks_of_worker.setdefault(worker.worker_id, set()).add(worker)
        parent: int | None = None
        live = self._live
        for key, local in zip(keys, block_hashes, strict=True):
            node = nodes.get(key)
            if node is None:
                node = nodes[key] = _Node(parent, local)
            ranks = node.ranks
            if worker not in ranks:
                live += 1
                rank_keys[key] = None
            ranks[worker] = expires
            parent = key
        self._live = live
        self._writes += 1
        heapq.heappush(self._heap, (expires, self._writes, worker, tuple(keys)))
        self._heap_keys += len(keys)
        if self._heap_keys > _HEAP_REBUILD_FACTOR * self._live + _HEAP_REBUILD_SLACK:
            self._rebuild_heap()

    def _drop(self, key: int, worker: WorkerWithDpRank) -> None:
        node = self._nodes[key]
        del node.ranks[worker]
        if not node.ranks:
            del self._nodes[key]
        rank_keys = self._by_rank[worker]
        del rank_keys[key]
        if not rank_keys:
            self._forget_rank(worker)
        self._live -= 1

    def _forget_rank(self, worker: WorkerWithDpRank) -> None:
        del self._by_rank[worker]
        ranks = self._ranks_of_worker[worker.worker_id]
        ranks.discard(worker)
        if not ranks:
            del self._ranks_of_worker[worker.worker_id]

    def expire(self, now_ns: int) -> int:
        """Remove every block whose expiry is ``<= now_ns``; returns how many were removed."""
        heap, nodes = self._heap, self._nodes
        removed = 0
        while heap and heap[0][0] <= now_ns:
            expires, _, worker, keys = heapq.heappop(heap)
            self._heap_keys -= len(keys)
            for key in keys:
                node = nodes.get(key)
                if node is not None and node.ranks.get(worker) == expires:
                    self._drop(key, worker)
                    removed += 1
        return removed

    def remove_rank(self, worker: WorkerWithDpRank) -> int:
        """Forget everything ``worker`` holds (its heap entries go stale); returns blocks dropped."""
        rank_keys = self._by_rank.get(worker)
        if rank_keys is None:
            return 0
        nodes = self._nodes
        for key in rank_keys:
            node = nodes[key]
            del node.ranks[worker]
            if not node.ranks:
                del nodes[key]
        n = len(rank_keys)
        self._live -= n
        self._forget_rank(worker)
        return n

    def remove_worker(self, worker_id: int) -> int:
        """Forget every rank of ``worker_id``; returns blocks dropped."""
        return sum(self.remove_rank(r) for r in list(self._ranks_of_worker.get(worker_id, ())))

    def _rebuild_heap(self) -> None:
        """One entry per (rank, expiry) of the live blocks, without the stale entries."""
        groups: dict[tuple[int, WorkerWithDpRank], list[int]] = {}
        for key, node in self._nodes.items():
            for worker, expires in node.ranks.items():
                groups.setdefault((expires, worker), []).append(key)
        self._heap = []
        for (expires, worker), keys in groups.items():
            self._writes += 1
            self._heap.append((expires, self._writes, worker, tuple(keys)))
        heapq.heapify(self._heap)
        self._heap_keys = self._live

    # -- reads -------------------------------------------------------------------------------------

    def overlaps(
        self, block_hashes: Sequence[int], now_ns: int, *, chain: Sequence[int] | None = None
    ) -> dict[WorkerWithDpRank, int]:
        """Leading blocks of the prompt each rank holds at ``now_ns`` (ranks with 0 omitted).

        Expired blocks are swept first; then every stored block is live, and a rank holding a
        block holds all its ancestors (a write covers the chain from block 0 with one expiry, and
        a parent never expires before its child). So a rank's overlap is the deepest block of the
        prompt's path it holds: the walk follows the path's nodes, and only where the number of
        holders shrinks from one depth to the next does it compare rank sets, in C.
        """
        if not block_hashes:
            return {}
        self.expire(now_ns)
        keys = chain if chain is not None else chained_hashes(block_hashes)
        nodes = self._nodes
        path: list[dict[WorkerWithDpRank, int]] = []
        for key in keys:
            node = nodes.get(key)
            if node is None:
                break
            path.append(node.ranks)
        if not path:
            return {}
        deeper = path[-1]
        result = dict.fromkeys(deeper, len(path))
        probes = len(path) + len(deeper)
        for depth in range(len(path) - 1, 0, -1):
            ranks = path[depth - 1]
            if len(ranks) != len(deeper):
                probes += len(ranks)
                for w in ranks.keys() - deeper.keys():
                    result[w] = depth
            deeper = ranks
        self.lookup_probes += probes
        return result

    def blocks(self, now_ns: int) -> Iterator[CachedBlock]:
        """Every live block, rank by rank, a parent before its children (for ``/dump``)."""
        nodes = self._nodes
        for worker, keys in self._by_rank.items():
            for key in keys:
                node = nodes[key]
                expires = node.ranks[worker]
                if expires > now_ns:
                    yield CachedBlock(worker, key, node.parent, node.local, expires)

    def stored_runs(self, now_ns: int) -> Iterator[StoredRun]:
        """Every live block as ``/dump``'s stored events: per rank, maximal single-child runs.

        A run starts at a block whose parent the rank does not hold (``parent_hash`` None for
        block 0) or at a child of a branching block, and continues while the block has exactly
        one live child on that rank. Ranks in first-write order, parents before children.
        """
        nodes = self._nodes
        for worker, keys in self._by_rank.items():
            live = [k for k in keys if nodes[k].ranks[worker] > now_ns]
            if not live:
                continue
            alive = set(live)
            children: dict[int, list[int]] = {}
            roots: list[int] = []
            for key in live:
                parent = nodes[key].parent
                if parent is not None and parent in alive:
                    children.setdefault(parent, []).append(key)
                else:
                    roots.append(key)
            starts = [(nodes[k].parent, k) for k in roots]
            while starts:
                parent, key = starts.pop(0)
                run = [(key, nodes[key].local)]
                kids = children.get(key, ())
                while len(kids) == 1:
                    key = kids[0]
                    run.append((key, nodes[key].local))
                    kids = children.get(key, ())
                starts.extend((key, k) for k in kids)
                yield StoredRun(worker, parent, tuple(run))

    # -- snapshots ---------------------------------------------------------------------------------

    def export(self, now_ns: int) -> list[list[int]]:
        """The live blocks as rows ``[worker_id, dp_rank, key, parent or -1, local, expires]``,
        per rank with parents first, hashes as u64 (the snapshot's form: -1 is no hash);
        ``restore`` takes them back; ``expires`` as stored."""
        u = to_unsigned
        return [
            [b.worker.worker_id, b.worker.dp_rank, u(b.block_hash),
             -1 if b.parent_hash is None else u(b.parent_hash), u(b.tokens_hash), b.expires_at_ns]
            for b in self.blocks(now_ns)
        ]  # fmt: skip

    def restore(self, rows: Sequence[Sequence[int]], shift_ns: int = 0) -> None:
        """Replace the content by an ``export``'s rows, every expiry moved by ``shift_ns`` (from
        another clock to this one). Raises ``ValueError`` on a malformed row, leaving the cache
        empty."""
        self._nodes, self._by_rank, self._ranks_of_worker = {}, {}, {}
        self._heap, self._heap_keys, self._live = [], 0, 0
        nodes = self._nodes
        try:
            for worker_id, dp_rank, u64_key, parent, local, expires in rows:
                worker = WorkerWithDpRank(worker_id, dp_rank)
                key = to_signed(u64_key)
                node = nodes.get(key)
                if node is None:
                    node = nodes[key] = _Node(
                        None if parent == -1 else to_signed(parent), to_signed(local)
                    )
                rank_keys = self._by_rank.get(worker)
                if rank_keys is None:
                    rank_keys = self._by_rank[worker] = {}
                    self._ranks_of_worker.setdefault(worker_id, set()).add(worker)
                if worker not in node.ranks:
                    self._live += 1
                    rank_keys[key] = None
                node.ranks[worker] = expires + shift_ns
        except (TypeError, ValueError) as e:
            self.restore([])
            raise ValueError(f"malformed approximate-cache row: {e}") from None
        self._rebuild_heap()

    def ranks(self) -> list[WorkerWithDpRank]:
        """Ranks holding at least one block (expired or not yet swept)."""
        return list(self._by_rank)

    def __len__(self) -> int:
        """Stored (rank, block) entries, including expired ones not yet swept by ``expire``."""
        return self._live


def chain_keys(block_hashes: Sequence[int]) -> list[int]:
    """The cache keys of a prompt's blocks: the chained hashes of its (signed) block hashes."""
    return chained_hashes(block_hashes)


class ChainSource(Protocol):
    """What ``cache_chain`` reads of a prompt (a ``Prompt`` or a pending selection)."""

    @property
    def block_hashes(self) -> tuple[int, ...] | None: ...
    @property
    def sequence_hashes(self) -> tuple[int, ...]: ...
    @property
    def from_tokens(self) -> bool: ...


def cache_chain(prompt: ChainSource) -> tuple[int, ...] | None:
    """The approximate-cache keys of a prompt's blocks: its sequence hashes for a token prompt,
    else the chained block hashes (computed once per request, used by lookup and write)."""
    if prompt.block_hashes is None:
        return None
    if prompt.from_tokens:
        return prompt.sequence_hashes
    return tuple(chain_keys(prompt.block_hashes))
