"""The index of real cache contents: which blocks each rank holds, fed by the engines' KV events.

Why it exists: with KV events on (the reference's default) the router does not guess what a rank
caches from what it routed there (``approx_cache``); each engine publishes the blocks it stores,
removes and clears, and overlap scores read this index. One index per partition ``(model_name,
routing_group)``.

How a block is identified. An engine names its blocks with its own hashes (``block_hash``,
vLLM's ``ExternalBlockHash``; any 64-bit value, signed or not, given here in the service's
signed form: ``kv_slot_tracker.core.hashing``) and links a stored run to its parent by that
hash. Prompts arrive here as the router's *local* hashes (xxh3 of the block's tokens,
``compute_block_hash_for_seq`` with the partition's block size and LoRA name), so a stored block
is re-hashed from the ``token_ids`` the event carries (``local_hashes``) and then keyed by its
*chain key*: the chained local hashes from block 0 (``chained_hashes``), which is the prompt's
own sequence hash at that depth. Every hash here is signed. The engine's hash only serves to
find a parent and to remove a block; the parent's chain key and the new block's local hash give
the new chain key. Device blocks live in the reference's compressed radix tree (runs of blocks
shared by the ranks that stored them, see ``KvIndex``); host and disk blocks per rank and tier
as ``engine hash -> (chain key, local hash, parent engine hash)`` with, per chain key, the ranks
holding it.

What the reference does, and so this index (verified on ai-dynamo-runtime 1.6.1):

* ``BlockStored`` in the device tier with a parent the rank does not hold there is skipped whole;
  a host or disk block's parent may be in any tier, and when the rank holds it nowhere the blocks
  are kept (``/dump`` lists them) under a key no prompt reaches; a store repeating a hash (the
  parent included) is dropped; an event whose ``block_size`` differs from
  the partition's, or whose ``token_ids`` cover fewer blocks than it names, stores the full blocks
  it covers and stops (``local_hashes``).
* A host or disk block already held under another parent stays there, and the store stops at it
  (the blocks after it are not kept); one held in the same place is kept as it is.
* ``BlockRemoved`` drops the named blocks of that tier from the rank. In the device tier a block
  goes with the rest of its run that the rank holds, where a run is a node of the reference's
  tree: the blocks stored together that no other store has split (stores ``[1,2,3]``, removes
  ``2``: ``/dump`` lists ``1`` only and a later store under ``3`` is refused). Runs below it are
  kept (listed by ``/dump`` under their parent, reachable as store parents, but no prompt reaches
  them through the removed block), unless no rank holds the run whole any more: then they drop
  out of reach. A removal event's consecutive hashes of one run act from the first of them in
  the run. In the host and disk tiers just the named blocks go. Unknown hashes are skipped.
* ``AllBlocksCleared`` empties the publishing rank, every tier (other dp ranks of the worker keep
  theirs).
* Tiers: ``device`` (GPU), ``host_pinned`` (CPU) and ``disk``; a rank's overlap is its device
  prefix ``d``, then the ``host_pinned`` extension (consecutive blocks from depth ``d`` held in
  host memory), then the ``disk`` extension after that. ``/overlap_scores`` reports
  ``host_pinned_blocks = d + host_ext`` and ``disk_blocks = host_pinned_blocks + disk_ext``.

Cost: a store or removal is proportional to its blocks, plus, where a store splits a run, the
moved part of the run times its holders (as the reference); finding a block in a run searches
at most ``_LONG`` positions (longer runs keep an index); clearing a rank is proportional to the
blocks it holds; a lookup walks the prompt's chain keys once per non-empty tier and visits ranks
only where some stop matching (never a scan over the partition's ranks or blocks). Pure: no
time, I/O or asyncio.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TypeVar

import xxhash

from ..hashing import (
    XXH3_SEED,
    chained_hashes,
    compute_block_hash_for_seq,
    signed_hashes,
    to_signed,
)
from ..types import WorkerWithDpRank

DEVICE, HOST_PINNED, DISK = 0, 1, 2
TIERS = (DEVICE, HOST_PINNED, DISK)
TIER_NAMES = ("device", "host_pinned", "disk")

# The engines' medium names (vLLM's ``medium``; the reference's ``StorageTier::from_kv_medium``).
# A missing or unknown medium is the device tier; an external/shared medium is no tier of a rank.
_MEDIA = {
    "GPU": DEVICE,
    "DEVICE": DEVICE,
    "CPU": HOST_PINNED,
    "CPU_PINNED": HOST_PINNED,
    "CPU_TIER1": HOST_PINNED,
    "CPU_TIER2": DISK,
    "DISK": DISK,
    "NVME": DISK,
}
_EXTERNAL = frozenset({"EXTERNAL", "NETWORK", "REMOTE", "SHARED"})

_h = xxhash.xxh3_64_intdigest
_pack = struct.Struct("<qq").pack


def tier_of_medium(medium: str | None) -> int | None:
    """The tier of an event's ``medium``; ``None`` for a medium outside the workers (ignored)."""
    if medium is None:
        return DEVICE
    if medium in _EXTERNAL:
        return None
    return _MEDIA.get(medium, DEVICE)


def chain_key(parent_key: int | None, local_hash: int) -> int:
    """The chain key of a block: its local hash at depth 0, else xxh3 of (parent key, local)."""
    if parent_key is None:
        return local_hash
    return to_signed(_h(_pack(parent_key, local_hash), seed=XXH3_SEED))


def orphan_key(parent_hash: int) -> int:
    """The chain key standing for a host/disk block's parent that the rank does not hold."""
    return to_signed(_h(_pack(parent_hash, _ORPHAN), seed=XXH3_SEED))


_ORPHAN = 0x6F7270_68616E  # any constant: it only separates these keys from the chain keys


def local_hashes(
    token_ids: Sequence[int],
    event_block_size: int,
    num_blocks: int,
    block_size: int,
    lora_name: str | None = None,
) -> list[int]:
    """The router's local hash of each stored block, as the reference derives them: only when the
    event's block size is the partition's, and only for the blocks ``token_ids`` fully covers
    (at most ``num_blocks``), signed."""
    if event_block_size != block_size or block_size <= 0:
        return []
    n = min(num_blocks, len(token_ids) // block_size)
    return signed_hashes(
        compute_block_hash_for_seq(list(token_ids[: n * block_size]), block_size, lora_name)
    )


@dataclass(frozen=True, slots=True)
class TierOverlap:
    """A rank's cached prefix of a prompt: device blocks, then the host and disk extensions."""

    device: int
    host_extension: int = 0
    disk_extension: int = 0


@dataclass(frozen=True, slots=True)
class IndexedBlock:
    """One block of one rank and tier, as ``/dump`` lists it."""

    worker: WorkerWithDpRank
    tier: int
    block_hash: int
    """The engine's hash (signed)."""
    parent_hash: int | None
    """The engine's hash of the parent block, ``None`` at depth 0."""
    tokens_hash: int
    """The router's local hash (signed)."""


Ranks = set[WorkerWithDpRank] | frozenset[WorkerWithDpRank]

Holders = WorkerWithDpRank | dict[WorkerWithDpRank, None]
"""The ranks holding a chain key: the rank itself when one does (the usual case), else a dict."""


def _members(held: Holders) -> AbstractSet[WorkerWithDpRank]:
    """``held`` as a set-like of ranks (a dict's keys view, or a one-rank frozenset)."""
    return held.keys() if type(held) is dict else frozenset((held,))  # type: ignore[arg-type]


def _holds(held: Holders, worker: WorkerWithDpRank) -> bool:
    return worker in held if type(held) is dict else held == worker


_LONG = 48
"""Edges longer than this keep a dict from engine hash to position (shorter ones are searched)."""


class _Node:
    """A run of device blocks shared by the ranks that stored it (one edge of the reference's
    compressed radix tree): per block its chain key, engine hash and local hash, side by side in
    one array (``edge[3 i : 3 i + 3]``); ``full`` the ranks holding the whole run, ``cut`` those
    holding only its first ``c`` blocks (``0 < c < len``). A run held whole by one rank shares
    that rank's one-rank frozenset (most runs); ``full`` becomes a set of its own when a second
    rank joins."""

    __slots__ = ("edge", "index", "full", "cut", "children", "internal")

    def __init__(self, edge: array[int], full: Ranks) -> None:
        self.edge = edge
        self.index: dict[int, int] | None = _index_of(edge)
        self.full = full
        self.cut: dict[WorkerWithDpRank, int] | None = None
        # first chain key of the child run -> child; None while the node has none
        self.children: dict[int, _Node] | None = None
        # once a node has had a child it is never extended in place again (sticky)
        self.internal = False


def _index_of(edge: array[int]) -> dict[int, int] | None:
    return {h: i for i, h in enumerate(edge[1::3])} if len(edge) > 3 * _LONG else None


def _pos(node: _Node, h: int) -> int:
    """The position of engine hash ``h`` in the node's run, -1 when absent."""
    idx = node.index
    if idx is not None:
        return idx.get(h, -1)
    edge = node.edge
    i = 0
    try:
        while True:
            i = edge.index(h, i)
            if i % 3 == 1:
                return i // 3
            i += 1
    except ValueError:
        return -1


def _cutoff(node: _Node, worker: WorkerWithDpRank) -> int:
    """How many of the node's blocks ``worker`` holds (always a prefix of the run)."""
    if worker in node.full:
        return len(node.edge) // 3
    cut = node.cut
    return cut.get(worker, 0) if cut else 0


def _add(node: _Node, worker: WorkerWithDpRank, solo: frozenset[WorkerWithDpRank]) -> None:
    """Add ``worker`` to the run's full holders (``solo``: its one-rank frozenset)."""
    full = node.full
    if not full:
        node.full = solo
    elif type(full) is frozenset:
        node.full = {*full, worker}
    else:
        full.add(worker)  # type: ignore[union-attr]  # a set: not the frozenset


def _discard(node: _Node, worker: WorkerWithDpRank) -> None:
    full = node.full
    if worker not in full:
        return
    if type(full) is frozenset:
        node.full = _NOBODY
    else:
        full.discard(worker)  # type: ignore[union-attr]  # a set: not the frozenset


_NOBODY: frozenset[WorkerWithDpRank] = frozenset()


def _promote(node: _Node, worker: WorkerWithDpRank, solo: frozenset[WorkerWithDpRank]) -> None:
    if worker in node.full:
        return
    cut = node.cut
    if cut and cut.pop(worker, None) is not None and not cut:
        node.cut = None
    _add(node, worker, solo)


def _cover_prefix(
    node: _Node, worker: WorkerWithDpRank, n: int, solo: frozenset[WorkerWithDpRank]
) -> None:
    if n >= len(node.edge) // 3:
        _promote(node, worker, solo)
    elif n > 0 and worker not in node.full:
        cut = node.cut
        if cut is None:
            node.cut = {worker: n}
        elif cut.get(worker, 0) < n:
            cut[worker] = n


def _drop(node: _Node, worker: WorkerWithDpRank) -> bool:
    """Take ``worker`` off the node; True when it held some of it."""
    if worker in node.full:
        _discard(node, worker)
        return True
    cut = node.cut
    if cut and cut.pop(worker, None) is not None:
        if not cut:
            node.cut = None
        return True
    return False


def _extend_leaf(
    node: _Node,
    worker: WorkerWithDpRank,
    solo: frozenset[WorkerWithDpRank],
    tail: array[int],
) -> None:
    """Append blocks to a leaf run: ``worker`` holds all of it, the other full holders keep
    the old length."""
    old = len(node.edge) // 3
    others = [w for w in node.full if w != worker]
    if others:
        cut = node.cut
        if cut is None:
            cut = node.cut = {}
        for w in others:
            cut[w] = old
        node.full = _NOBODY
    _promote(node, worker, solo)
    node.edge.extend(tail)
    idx = node.index
    if idx is not None:
        for i, h in enumerate(tail[1::3], old):
            idx[h] = i
    else:
        node.index = _index_of(node.edge)


# A per-rank map whose table holds four times the bytes its entries need (a right-sized dict
# takes at most 54 bytes an entry) is copied to a right-sized one after removals.
_SPARSE_BYTES_PER_ENTRY = 4 * 54
_SMALL_MAP_BYTES = 4096
_V = TypeVar("_V")


def _compact(d: dict[int, _V]) -> dict[int, _V]:
    """``d``, or a right-sized copy of it once removals left its table four times too large.

    A Python dict never shrinks its table on deletions: a rank's map that grew during a burst
    of stores and then lost most of its blocks would keep the burst's memory until the rank
    is cleared. Copying costs one pass over what is left, and the next copy needs the map to
    shrink fourfold again, so removals stay O(1) amortized."""
    if sys.getsizeof(d) > _SPARSE_BYTES_PER_ENTRY * len(d) + _SMALL_MAP_BYTES:
        return dict(d)
    return d


class KvIndex:
    """Blocks per rank and tier of one partition.

    The device tier is the reference's compressed radix tree, shared by the partition's ranks:
    runs of blocks (``_Node``) keyed under their parent run by their first chain key, each with
    the ranks holding all or a prefix of it, and per rank ``engine hash -> run``. The host and
    disk tiers keep, per rank, ``engine hash -> (chain key, local hash, parent)`` and per chain
    key its holders."""

    def __init__(self) -> None:
        self._root = _Node(array("q"), _NOBODY)
        self._root.internal = True
        # rank -> its one-rank frozenset, shared by the runs it alone holds whole
        self._solos: dict[WorkerWithDpRank, frozenset[WorkerWithDpRank]] = {}
        # rank -> engine hash -> the device run holding it
        self._lookup: dict[WorkerWithDpRank, dict[int, _Node]] = {}
        # host and disk tiers: tier -> chain key -> the rank holding it, or a dict (ordered set)
        # when several do (the device entry is unused)
        self._holders: tuple[dict[int, Holders], ...] = ({}, {}, {})
        # rank -> per tier: engine hash -> (chain key, local hash, parent engine hash or None)
        self._ranks: dict[WorkerWithDpRank, tuple[dict[int, tuple[int, int, int | None]], ...]] = {}
        self._ranks_of_worker: dict[int, set[WorkerWithDpRank]] = {}
        self._lower_size = 0
        self.lookup_probes = 0
        """Work done by ``overlaps``: chain keys compared plus ranks dropped (never reset)."""

    # -- writes ------------------------------------------------------------------------------------

    def _note_rank(self, worker: WorkerWithDpRank) -> None:
        self._ranks_of_worker.setdefault(worker.worker_id, set()).add(worker)

    def _rank(self, worker: WorkerWithDpRank) -> tuple[dict[int, tuple[int, int, int | None]], ...]:
        maps = self._ranks.get(worker)
        if maps is None:
            maps = self._ranks[worker] = ({}, {}, {})
            self._note_rank(worker)
        return maps

    def _parent_key(self, worker: WorkerWithDpRank, tier: int, parent: int) -> int | None:
        """The chain key of ``parent`` as ``worker`` holds it, looked up in ``tier`` first and
        then in every tier; None when the rank holds it nowhere."""
        maps = self._ranks.get(worker)
        if maps is not None:
            entry = maps[tier].get(parent)
            if entry is not None:
                return entry[0]
        lk = self._lookup.get(worker)
        if lk is not None:
            node = lk.get(parent)
            if node is not None:
                pos = _pos(node, parent)
                if pos >= 0:
                    return node.edge[3 * pos]
        if maps is not None:
            for other in (HOST_PINNED, DISK):
                entry = maps[other].get(parent)
                if entry is not None:
                    return entry[0]
        return None

    def store(
        self,
        worker: WorkerWithDpRank,
        tier: int,
        parent_hash: int | None,
        blocks: Sequence[tuple[int, int]],
    ) -> bool:
        """Store ``blocks`` (``(engine hash, local hash)`` each, signed, in order) on ``worker``
        in ``tier`` under the parent ``parent_hash`` (an engine hash, or ``None`` for block 0).

        Returns False, storing nothing, when the parent is unknown on the rank or a hash repeats.
        """
        parent = parent_hash
        hashes = [b for b, _ in blocks]
        seen = set(hashes)
        if len(seen) != len(hashes) or (parent is not None and parent in seen):
            return False
        locals_ = [local for _, local in blocks]
        if tier == DEVICE:
            return self._store_device(worker, parent, hashes, locals_)
        parent_key: int | None = None
        if parent is not None:
            parent_key = self._parent_key(worker, tier, parent)
            if parent_key is None:  # kept under a key no prompt can reach, as the reference
                parent_key = orphan_key(parent)
        if not blocks:
            return True
        mine = self._rank(worker)[tier]
        holders = self._holders[tier]
        prev = parent
        for h, local in zip(hashes, locals_, strict=True):
            old = mine.get(h)
            if old is not None:
                if old[1] != local or old[2] != prev:
                    break  # held under another parent: the first store wins, the walk stops
                parent_key, prev = old[0], h
                continue
            key = chain_key(parent_key, local)
            mine[h] = (key, local, prev)
            held = holders.get(key)
            if held is None:
                holders[key] = worker
            elif type(held) is dict:
                held[worker] = None
            elif held != worker:
                holders[key] = {held: None, worker: None}  # type: ignore[dict-item]
            self._lower_size += 1
            parent_key, prev = key, h
        return True

    def _store_device(
        self, worker: WorkerWithDpRank, parent: int | None, hashes: list[int], locals_: list[int]
    ) -> bool:
        """The reference's store into its radix tree (1.6.1): from the root, or from the run
        holding the parent (refused when the rank does not hold it); runs the blocks match are
        shared, a run is split where a store leaves it, and a leaf run the rank holds to its
        end is extended in place."""
        lk = self._lookup.get(worker)
        node = self._root
        pos = -1
        pkey: int | None = None
        if parent is not None:
            found = lk.get(parent) if lk is not None else None
            if found is None:
                return False
            pos = _pos(found, parent)
            if pos < 0:
                return False
            if pos >= _cutoff(found, worker):  # a stale entry: forgotten, the store refused
                del lk[parent]  # type: ignore[union-attr]  # found in it: not None
                return False
            node = found
            pkey = node.edge[3 * pos]
        if lk is None:
            lk = self._lookup[worker] = {}
            self._note_rank(worker)
        solo = self._solo(worker)
        total = len(hashes)
        if not total:
            return True
        ed = array("q", bytes(24 * total))  # (chain key, engine hash, local hash) per block
        ed[0::3] = array("q", chained_hashes(locals_, pkey))
        ed[1::3] = array("q", hashes)
        ed[2::3] = array("q", locals_)
        run = len(node.edge) // 3
        if parent is not None and pos != run - 1:
            # the parent is inside the run: reuse the run's rest, extend a leaf, or split
            rest = run - pos - 1
            at = 3 * (pos + 1)
            if total <= rest:
                if node.edge[at : at + 3 * total] == ed:
                    _cover_prefix(node, worker, pos + 1 + total, solo)
                    for h in hashes:
                        lk[h] = node
                    return True
            elif not node.internal and node.edge[at:] == ed[: 3 * rest]:
                _extend_leaf(node, worker, solo, ed[3 * rest :])
                for h in hashes:
                    lk[h] = node
                return True
            self._split(node, pos + 1)
        last = parent
        i = 0
        while i < total:
            kids = node.children
            first = ed[3 * i]
            child = kids.get(first) if kids else None
            if child is None:
                if (
                    last is not None
                    and not node.internal
                    and node.edge[-2] == last
                    and len(node.edge) // 3 <= _cutoff(node, worker)
                ):
                    _extend_leaf(node, worker, solo, ed[3 * i :])
                    for h in hashes[i:]:
                        lk[h] = node
                    return True
                new = _Node(ed[3 * i :], solo)
                if kids is None:
                    kids = node.children = {}
                kids[first] = new
                node.internal = True
                for h in hashes[i:]:
                    lk[h] = new
                return True
            ce = child.edge
            e = len(ce) // 3
            lim = min(e, total - i)
            m = 1
            while m < lim and ce[3 * m] == ed[3 * (i + m)]:
                m += 1
            if m < e:
                if m == total - i:  # the store ends inside the run: the rank holds a prefix
                    _cover_prefix(child, worker, m, solo)
                    for h in hashes[i:]:
                        lk[h] = child
                    return True
                self._split(child, m)
                _promote(child, worker, solo)
                tail = _Node(ed[3 * (i + m) :], solo)
                child.children[ed[3 * (i + m)]] = tail  # type: ignore[index]
                for h in hashes[i : i + m]:
                    lk[h] = child
                for h in hashes[i + m :]:
                    lk[h] = tail
                return True
            _promote(child, worker, solo)
            for h in hashes[i : i + e]:
                lk[h] = child
            last = hashes[i + e - 1]
            i += e
            node = child
        return True

    def _solo(self, worker: WorkerWithDpRank) -> frozenset[WorkerWithDpRank]:
        solo = self._solos.get(worker)
        if solo is None:
            solo = self._solos[worker] = frozenset((worker,))
        return solo

    def _split(self, node: _Node, pos: int) -> _Node:
        """Cut ``node``'s run before ``pos``: the rest becomes its only child, with the node's
        children and the holders that reach into it."""
        full = node.full
        suffix = _Node(node.edge[3 * pos :], full if type(full) is frozenset else set(full))
        del node.edge[3 * pos :]
        node.index = _index_of(node.edge)
        cut = node.cut
        if cut:
            rest: dict[WorkerWithDpRank, int] = {}
            for w, c in list(cut.items()):
                if c >= pos:
                    del cut[w]
                    _add(node, w, self._solo(w))
                    if c > pos:
                        rest[w] = c - pos
            if not cut:
                node.cut = None
            suffix.cut = rest or None
        suffix.children = node.children
        suffix.internal = node.internal
        node.children = {suffix.edge[0]: suffix}
        node.internal = True
        lookup = self._lookup
        for w in suffix.full:
            lk = lookup.get(w)
            if lk is not None:
                for h in suffix.edge[1::3]:
                    lk[h] = suffix
        if suffix.cut:
            for w, c in suffix.cut.items():
                lk = lookup.get(w)
                if lk is not None:
                    for h in suffix.edge[1 : 3 * c : 3]:
                        lk[h] = suffix
        return suffix

    @staticmethod
    def _unhold(holders: dict[int, Holders], key: int, worker: WorkerWithDpRank) -> None:
        held = holders.get(key)
        if held is None:
            return
        if type(held) is dict:
            held.pop(worker, None)
            if len(held) == 1:
                holders[key] = next(iter(held))
            elif not held:
                del holders[key]
        elif held == worker:
            del holders[key]

    def remove(self, worker: WorkerWithDpRank, tier: int, block_hashes: Sequence[int]) -> int:
        """Drop the named blocks of ``tier`` from ``worker``; returns how many blocks went.

        In the device tier, as the reference's tree: a removed block takes with it the rest of
        its run that the rank holds (the blocks the run's holders stored together), but not the
        runs below it (the rank keeps them; no prompt reaches them through the removed block).
        Consecutive hashes of one run are removed from the first of them in the run."""
        if tier != DEVICE:
            maps = self._ranks.get(worker)
            if maps is None:
                return 0
            mine = maps[tier]
            holders = self._holders[tier]
            removed = 0
            for h in block_hashes:
                entry = mine.pop(h, None)
                if entry is not None:
                    self._unhold(holders, entry[0], worker)
                    removed += 1
            self._lower_size -= removed
            if removed:
                compact = _compact(mine)
                if compact is not mine:
                    self._ranks[worker] = tuple(
                        compact if t == tier else m for t, m in enumerate(maps)
                    )
                self._compact_holders(tier)
            return removed
        lk = self._lookup.get(worker)
        if lk is None:
            return 0
        before = len(lk)
        node: _Node | None = None
        group: list[int] = []
        for h in block_hashes:
            if node is not None and _pos(node, h) >= 0:
                group.append(h)
                continue
            if node is not None:
                self._remove_group(lk, worker, node, group)
            node = lk.get(h)
            group = [h]
        if node is not None:
            self._remove_group(lk, worker, node, group)
        if len(lk) < before:
            self._lookup[worker] = _compact(lk)
        return before - len(lk)

    def _remove_group(
        self, lk: dict[int, _Node], worker: WorkerWithDpRank, node: _Node, group: list[int]
    ) -> None:
        best, best_hash = -1, 0
        unmatched = []
        for h in group:
            p = _pos(node, h)
            if p < 0:
                unmatched.append(h)
            elif best < 0 or p < best:
                best, best_hash = p, h
        if best < 0:
            for h in group:
                lk.pop(h, None)
            return
        self._cut(lk, worker, node, best, best_hash)
        for h in unmatched:
            other = lk.get(h)
            if other is None:
                continue
            p = _pos(other, h)
            if p < 0:
                del lk[h]
            else:
                self._cut(lk, worker, other, p, h)

    @staticmethod
    def _cut(lk: dict[int, _Node], worker: WorkerWithDpRank, node: _Node, pos: int, h: int) -> None:
        """``worker`` keeps only the blocks of ``node`` before ``pos``; a run no rank holds whole
        any more loses its children (they stay in their holders' maps, out of every prompt's
        and the dump's reach)."""
        if pos >= _cutoff(node, worker):
            lk.pop(h, None)
        else:
            for s in node.edge[3 * pos + 1 :: 3]:
                lk.pop(s, None)
            if pos == 0:
                _drop(node, worker)
            else:
                _discard(node, worker)
                if node.cut is None:
                    node.cut = {}
                node.cut[worker] = pos
        if not node.full and node.children:
            node.children = None

    def _compact_holders(self, tier: int) -> None:
        """Right-size ``tier``'s chain key -> holders map after removals (``_compact``)."""
        holders = self._holders[tier]
        compact = _compact(holders)
        if compact is not holders:
            self._holders = tuple(compact if t == tier else h for t, h in enumerate(self._holders))

    def clear_rank(self, worker: WorkerWithDpRank) -> int:
        """Forget every block ``worker`` holds, all tiers (``AllBlocksCleared``, a lost gap, a
        rank leaving); returns how many."""
        n = 0
        lk = self._lookup.pop(worker, None)
        self._solos.pop(worker, None)
        if lk is not None:
            n += len(lk)
            for node in set(lk.values()):
                if _drop(node, worker) and not node.full and node.children:
                    node.children = None
        maps = self._ranks.pop(worker, None)
        if maps is not None:
            for tier in (HOST_PINNED, DISK):
                holders = self._holders[tier]
                for key, _, _ in maps[tier].values():
                    self._unhold(holders, key, worker)
                n += len(maps[tier])
                self._lower_size -= len(maps[tier])
                if maps[tier]:
                    self._compact_holders(tier)
        if lk is None and maps is None:
            return 0
        ranks = self._ranks_of_worker[worker.worker_id]
        ranks.discard(worker)
        if not ranks:
            del self._ranks_of_worker[worker.worker_id]
        return n

    def remove_worker(self, worker_id: int) -> int:
        """Forget every rank of ``worker_id``; returns blocks dropped."""
        return sum(self.clear_rank(r) for r in list(self._ranks_of_worker.get(worker_id, ())))

    # -- reads -------------------------------------------------------------------------------------

    def overlaps(self, keys: Sequence[int]) -> dict[WorkerWithDpRank, TierOverlap]:
        """Each rank's cached prefix of a prompt given by its chain keys (ranks with nothing
        omitted): consecutive device blocks from block 0, then the host and disk extensions."""
        out: dict[WorkerWithDpRank, TierOverlap] = {}
        if not keys:
            return out
        device = self._device_prefix(keys)
        host_holders, disk_holders = self._holders[HOST_PINNED], self._holders[DISK]
        if not host_holders and not disk_holders:
            return {w: TierOverlap(d) for w, d in device.items()}
        n = len(keys)
        host = [host_holders.get(k) for k in keys] if host_holders else [None] * n
        disk = [disk_holders.get(k) for k in keys] if disk_holders else [None] * n
        self.lookup_probes += 2 * n
        lower: set[WorkerWithDpRank] = set()
        for col in (host, disk):
            for held in col:
                if held is not None:
                    lower.update(_members(held))
        for w, d in device.items():
            if w not in lower:
                out[w] = TierOverlap(d)
        for w in lower:
            d = device.get(w, 0)
            i = d
            while i < n and (held := host[i]) is not None and _holds(held, w):
                i += 1
            h = i - d
            while i < n and (held := disk[i]) is not None and _holds(held, w):
                i += 1
            self.lookup_probes += i - d
            if i:
                out[w] = TierOverlap(d, h, i - d - h)
        return out

    def _device_prefix(self, keys: Sequence[int]) -> dict[WorkerWithDpRank, int]:
        """Each rank's device prefix, as the reference's tree walk (1.6.1) scores it: the ranks
        holding the whole first run are active, those holding a prefix of it score that; at each
        deeper run an active rank scores where its hold ends and drops out. Where the run has
        no partial holders and as many full holders as there are active ranks, the reference
        takes them to be the active ranks and compares nothing (a rank can then be credited
        with a run it does not hold; this index gives the same scores). Work: the prompt's
        chain keys compared once, plus the ranks that drop out."""
        result: dict[WorkerWithDpRank, int] = {}
        n = len(keys)
        kids = self._root.children
        node = kids.get(keys[0]) if kids else None
        probes = 1
        if node is None:
            self.lookup_probes += probes
            return result
        active: set[WorkerWithDpRank] | None = None
        pos = 0
        while True:
            ne = node.edge
            e = len(ne) // 3
            walk = min(e, n - pos)
            m = 1
            while m < walk and ne[3 * m] == keys[pos + m]:
                m += 1
            probes += m
            cut = node.cut
            if active is None:
                active = set(node.full)
                if cut:
                    for w, c in cut.items():
                        result[w] = min(c, m)
            elif cut:
                full = node.full
                for w in [w for w in active if w not in full]:
                    c = cut.get(w)  # type: ignore[assignment]
                    result[w] = pos + (0 if c is None else min(c, m))
                    active.discard(w)
                    probes += 1
            elif len(node.full) != len(active):
                gone = active - node.full
                for w in gone:
                    result[w] = pos
                active -= gone
                probes += len(gone)
            pos += m
            if not active or m < e or pos == n:
                break
            kids = node.children
            node = kids.get(keys[pos]) if kids else None
            probes += 1
            if node is None:
                break
        for w in active:
            result[w] = pos
        self.lookup_probes += probes
        return result

    def blocks(self) -> Iterator[IndexedBlock]:
        """Every indexed block: the device runs reachable from the root (each rank's part of a
        run, under the run's parent block, as the reference's ``/dump``), then each rank's host
        and disk blocks in store order."""
        stack: list[tuple[_Node, int | None]] = [
            (c, None) for c in (self._root.children or {}).values()
        ]
        while stack:
            node, parent = stack.pop()
            hashes, locals_ = node.edge[1::3], node.edge[2::3]
            holds = [(w, len(hashes)) for w in node.full]
            if node.cut:
                holds += node.cut.items()
            for w, c in holds:
                prev = parent
                for i in range(c):
                    yield IndexedBlock(w, DEVICE, hashes[i], prev, locals_[i])
                    prev = hashes[i]
            if node.children:
                last = hashes[-1]
                stack.extend((c, last) for c in node.children.values())
        for worker, maps in self._ranks.items():
            for tier in (HOST_PINNED, DISK):
                for h, (_, local, parent) in maps[tier].items():
                    yield IndexedBlock(worker, tier, h, parent, local)

    def ranks(self) -> list[WorkerWithDpRank]:
        return list(dict.fromkeys([*self._lookup, *self._ranks]))

    def rank_size(self, worker: WorkerWithDpRank) -> int:
        lk = self._lookup.get(worker)
        maps = self._ranks.get(worker)
        return (0 if lk is None else len(lk)) + (0 if maps is None else sum(len(m) for m in maps))

    def __len__(self) -> int:
        """Indexed (rank, tier, block) entries (device: the blocks in the ranks' maps)."""
        return self._lower_size + sum(len(lk) for lk in self._lookup.values())

    # -- dump and load (an index handed from one instance to another) ------------------------------

    def entries_by_rank(self) -> dict[WorkerWithDpRank, list[tuple[int, int, int | None, int]]]:
        """Every block as ``(tier, engine hash, parent engine hash or None, local hash)``, per
        rank (from ``blocks``, parents first): what ``load_rank`` takes back."""
        out: dict[WorkerWithDpRank, list[tuple[int, int, int | None, int]]] = {}
        for b in self.blocks():
            out.setdefault(b.worker, []).append(
                (b.tier, b.block_hash, b.parent_hash, b.tokens_hash)
            )
        return out

    def load_rank(
        self, worker: WorkerWithDpRank, entries: Sequence[tuple[int, int, int | None, int]]
    ) -> int:
        """Store ``entries`` (as ``entries_by_rank`` gives them, in any order: a block waits for
        its parent) on ``worker``; returns how many could not be stored (a device block whose
        parent never came, or a store ``store`` refuses). Host and disk blocks whose parent never
        came are kept under an orphan key, as ``store`` keeps them. Consecutive entries of one
        chain are stored as one run."""
        runs: list[tuple[int, int | None, list[tuple[int, int]]]] = []
        last = None
        for tier, h, parent, local in entries:
            if runs and tier == runs[-1][0] and parent is not None and parent == last:
                runs[-1][2].append((h, local))
            else:
                runs.append((tier, parent, [(h, local)]))
            last = h
        waiting: dict[int, list[tuple[int, int | None, list[tuple[int, int]]]]] = {}
        runs.reverse()
        refused = 0
        while runs:
            tier, parent, blocks = run = runs.pop()
            if parent is not None and not self._holds_parent(worker, tier, parent):
                waiting.setdefault(parent, []).append(run)
                continue
            if not self.store(worker, tier, parent, blocks):
                refused += self._store_singly(worker, tier, parent, blocks)
            if waiting:
                for h, _ in blocks:
                    runs.extend(reversed(waiting.pop(h, ())))
        for left in waiting.values():
            for tier, parent, blocks in left:
                if tier == DEVICE:
                    refused += len(blocks)
                elif not self.store(worker, tier, parent, blocks):
                    refused += self._store_singly(worker, tier, parent, blocks)
        return refused

    def _store_singly(
        self, worker: WorkerWithDpRank, tier: int, parent: int | None, blocks: list[tuple[int, int]]
    ) -> int:
        """A run ``store`` refused, block by block (each under the previous); how many failed."""
        refused = 0
        for h, local in blocks:
            if not self.store(worker, tier, parent, ((h, local),)):
                refused += 1
            parent = h
        return refused

    def _holds_parent(self, worker: WorkerWithDpRank, tier: int, parent: int) -> bool:
        """Whether ``store`` would find ``parent`` for a block of ``tier`` (device: in the
        device tier; host and disk: in any tier)."""
        if tier != DEVICE:
            return self._parent_key(worker, tier, parent) is not None
        lk = self._lookup.get(worker)
        return lk is not None and parent in lk
