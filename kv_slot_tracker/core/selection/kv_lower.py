"""The host, disk and external tiers of the index of real cache contents (``kv_index``), as
the reference's ``LowerTierIndexer``: a block is the edge ``(parent engine hash, local hash) ->
engine hash``, shared by the ranks storing it. The first store of an edge wins; a rank's walk
continues a prompt from where its device prefix stopped. Pure: no time, I/O or asyncio."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet

from ..types import WorkerWithDpRank
from .kv_blocks import (
    DISK,
    EXTERNAL,
    HOST_PINNED,
    LOWER_TIERS,
    IndexedBlock,
    StoredChain,
    compact,
    edge_key,
)

Holders = WorkerWithDpRank | dict[WorkerWithDpRank, None]
"""The ranks holding a chain key: the rank itself when one does (the usual case), else a dict."""


def _members(held: Holders) -> AbstractSet[WorkerWithDpRank]:
    """``held`` as a set-like of ranks (a dict's keys view, or a one-rank frozenset)."""
    return held.keys() if isinstance(held, dict) else frozenset((held,))


def _holds(held: Holders, worker: WorkerWithDpRank) -> bool:
    return worker in held if type(held) is dict else held == worker


class LowerTiers:
    """Per tier, edge key -> (the child's engine hash, its holders), and per rank and tier
    ``engine hash -> (edge key, local hash, parent engine hash)``."""

    def __init__(self, note_rank: Callable[[WorkerWithDpRank], None]) -> None:
        self._note_rank = note_rank  # told of each rank as its maps are made
        # tier -> edge key -> (the child's engine hash, the rank holding the edge, or a dict
        # (ordered set) when several do); the device entry is unused
        self._edges: tuple[dict[int, tuple[int, Holders]], ...] = ({}, {}, {}, {})
        # rank -> per tier: engine hash -> (edge key, local hash, parent engine hash or None)
        self._ranks: dict[WorkerWithDpRank, tuple[dict[int, tuple[int, int, int | None]], ...]] = {}
        self.size = 0
        """Blocks held, every rank and tier."""
        self.probes = 0
        """Work done by ``walk``: edges probed (never reset)."""

    def _rank(self, worker: WorkerWithDpRank) -> tuple[dict[int, tuple[int, int, int | None]], ...]:
        maps = self._ranks.get(worker)
        if maps is None:
            maps = self._ranks[worker] = ({}, {}, {}, {})
            self._note_rank(worker)
        return maps

    def store(
        self,
        worker: WorkerWithDpRank,
        tier: int,
        parent: int | None,
        hashes: list[int],
        locals_: list[int],
    ) -> None:
        """The reference's lower-tier store (``LowerTierIndexer``): each block is the edge
        ``(parent engine hash, local hash) -> engine hash``, shared by the ranks storing it. The
        first store of an edge wins: a block whose edge leads to another engine hash (another
        rank stored the same tokens under other hashes), or that the rank holds under another
        edge, ends the store there. The parent need not be held anywhere."""
        mine = self._rank(worker)[tier]
        edges = self._edges[tier]
        prev = parent
        for h, local in zip(hashes, locals_, strict=True):
            key = edge_key(prev, local)
            old = mine.get(h)
            if old is not None and old[0] != key:
                break
            edge = edges.get(key)
            if edge is None:
                edges[key] = (h, worker)
            else:
                child, held = edge
                if child != h:
                    break
                if isinstance(held, dict):
                    held[worker] = None
                elif held != worker:
                    edges[key] = (h, {held: None, worker: None})
            if old is None:
                mine[h] = (key, local, prev)
                self.size += 1
            prev = h

    @staticmethod
    def _unhold(edges: dict[int, tuple[int, Holders]], key: int, worker: WorkerWithDpRank) -> None:
        edge = edges.get(key)
        if edge is None:
            return
        child, held = edge
        if type(held) is dict:
            held.pop(worker, None)
            if len(held) == 1:
                edges[key] = (child, next(iter(held)))
            elif not held:
                del edges[key]
        elif held == worker:
            del edges[key]

    def remove(self, worker: WorkerWithDpRank, tier: int, block_hashes: Sequence[int]) -> int:
        """Drop the named blocks of ``tier`` from ``worker``; returns how many went."""
        maps = self._ranks.get(worker)
        if maps is None:
            return 0
        mine = maps[tier]
        edges = self._edges[tier]
        removed = 0
        for h in block_hashes:
            entry = mine.pop(h, None)
            if entry is not None:
                self._unhold(edges, entry[0], worker)
                removed += 1
        self.size -= removed
        if removed:
            smaller = compact(mine)
            if smaller is not mine:
                self._ranks[worker] = tuple(smaller if t == tier else m for t, m in enumerate(maps))
            self._compact_edges(tier)
        return removed

    def _compact_edges(self, tier: int) -> None:
        """Right-size ``tier``'s edge map after removals (``compact``)."""
        edges = self._edges[tier]
        smaller = compact(edges)
        if smaller is not edges:
            self._edges = tuple(smaller if t == tier else e for t, e in enumerate(self._edges))

    def clear(self, worker: WorkerWithDpRank) -> int | None:
        """Forget every block ``worker`` holds in these tiers: how many (None: it has no maps)."""
        n = 0
        maps = self._ranks.pop(worker, None)
        if maps is not None:
            for tier in LOWER_TIERS:
                edges = self._edges[tier]
                for key, _, _ in maps[tier].values():
                    self._unhold(edges, key, worker)
                n += len(maps[tier])
                self.size -= len(maps[tier])
                if maps[tier]:
                    self._compact_edges(tier)
        return None if maps is None else n

    def walk(
        self, device: dict[WorkerWithDpRank, tuple[int, int]], locals_: Sequence[int]
    ) -> dict[WorkerWithDpRank, tuple[int, int]]:
        """The reference's lower-tier continuation (``query_lower_tiers``): per tier in
        ``LOWER_TIERS``, each rank walks the prompt's local hashes from where it stopped (its
        device prefix and the engine hash of its last device block; from block 0 for a rank
        holding the prompt's first block in that tier), following the edges it holds. Returns
        per rank its host hits and its disk plus external hits. Work: the edges walked, plus one
        probe per rank with a place to continue from in a tier."""
        n = len(locals_)
        conts: dict[WorkerWithDpRank, tuple[int, int | None]] = {
            w: (d, last) for w, (d, last) in device.items()
        }
        hits: dict[WorkerWithDpRank, list[int]] = {}
        probes = 0
        for tier in LOWER_TIERS:
            edges = self._edges[tier]
            if not edges:
                continue
            root = edges.get(locals_[0])
            if root is not None:
                for w in _members(root[1]):
                    if w not in conts:
                        conts[w] = (0, None)
            for w, (pos, last) in conts.items():
                p = pos
                cur = last
                while p < n:
                    probes += 1
                    edge = edges.get(locals_[p] if cur is None else edge_key(cur, locals_[p]))
                    if edge is None or not _holds(edge[1], w):
                        break
                    cur = edge[0]
                    p += 1
                if p > pos:
                    conts[w] = (p, cur)
                    got = hits.get(w)
                    if got is None:
                        got = hits[w] = [0, 0]
                    got[0 if tier == HOST_PINNED else 1] += p - pos
        self.probes += probes
        return {w: (h[0], h[1]) for w, h in hits.items()}

    def has_edges(self) -> bool:
        """Whether any rank holds a block in these tiers."""
        edges = self._edges
        return bool(edges[HOST_PINNED] or edges[DISK] or edges[EXTERNAL])

    def blocks(self) -> Iterator[IndexedBlock]:
        """Each rank's blocks, tier by tier, in store order."""
        for worker, maps in self._ranks.items():
            for tier in LOWER_TIERS:
                for h, (_, local, parent) in maps[tier].items():
                    yield IndexedBlock(worker, tier, h, parent, local)

    def chains(self, tier: int) -> Iterator[StoredChain]:
        """``tier``'s blocks (host, disk or external), one chain each, as the reference's
        ``/dump`` gives them."""
        for worker, maps in self._ranks.items():
            for h, (_, local, parent) in maps[tier].items():
                yield StoredChain(worker, tier, parent, ((h, local),))

    def ranks(self) -> list[WorkerWithDpRank]:
        return list(self._ranks)
