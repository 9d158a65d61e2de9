"""The device tier of the index of real cache contents (``kv_index``): the reference's
compressed radix tree, shared by the partition's ranks. A run of blocks (``_Node``, one edge of
the tree) is keyed under its parent run by its first chain key and knows the ranks holding all
or a prefix of it; per rank, ``engine hash -> run``. Finding a block in a run searches at most
``_LONG`` positions (longer runs keep an index). Pure: no time, I/O or asyncio."""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Callable, Iterator, Sequence

from ..hashing import chained_hashes
from ..types import WorkerWithDpRank
from .kv_blocks import DEVICE, IndexedBlock, StoredChain, compact

Ranks = set[WorkerWithDpRank] | frozenset[WorkerWithDpRank]

_LONG = 48
"""Edges longer than this keep a dict from engine hash to position (shorter ones are searched)."""


class _Node:
    """A run of device blocks shared by the ranks that stored it (one edge of the reference's
    compressed radix tree): per block its chain key, engine hash and local hash, side by side in
    one array (``edge[3 i : 3 i + 3]``); ``full`` the ranks holding the whole run, ``cut`` those
    holding only its first ``c`` blocks (``0 < c < len``). A run held whole by one rank shares
    that rank's one-rank frozenset (most runs); ``full`` becomes a set of its own when a second
    rank joins."""

    __slots__ = ("edge", "index", "full", "cut", "children", "internal", "dead")

    def __init__(self, edge: array[int], full: Ranks) -> None:
        self.edge = edge
        self.index: dict[int, int] | None = _index_of(edge)
        self.full = full
        self.cut: dict[WorkerWithDpRank, int] | None = None
        # first chain key of the child run -> child; None while the node has none
        self.children: dict[int, _Node] | None = None
        # once a node has had a child it is never extended in place again (sticky)
        self.internal = False
        # dropped from the tree: no rank held it after a pruning clear (``clear_rank``); a
        # store reaching it from its parent puts a run of its own in its place
        self.dead = False


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
    elif isinstance(full, frozenset):
        node.full = {*full, worker}
    else:
        full.add(worker)


def _discard(node: _Node, worker: WorkerWithDpRank) -> None:
    full = node.full
    if worker not in full:
        return
    if isinstance(full, frozenset):
        node.full = _NOBODY
    else:
        full.discard(worker)


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


class DeviceTree:
    """Runs of device blocks (``_Node``) keyed under their parent run by their first chain key,
    each with the ranks holding all or a prefix of it, and per rank ``engine hash -> run``."""

    def __init__(self, note_rank: Callable[[WorkerWithDpRank], None]) -> None:
        self._note_rank = note_rank  # told of each rank as its lookup is made
        self._root = _Node(array("q"), _NOBODY)
        self._root.internal = True
        # rank -> its one-rank frozenset, shared by the runs it alone holds whole
        self._solos: dict[WorkerWithDpRank, frozenset[WorkerWithDpRank]] = {}
        # rank -> engine hash -> the device run holding it
        self._lookup: dict[WorkerWithDpRank, dict[int, _Node]] = {}
        # ranks that may hold runs their lookup no longer names (a run matched under other
        # engine hashes whose hashes were then removed, or a hash stored in two runs): clearing
        # one sweeps the tree, as the reference always does
        self._suspect: set[WorkerWithDpRank] = set()
        self.probes = 0
        """Work done by ``prefix``: chain keys compared plus ranks dropped (never reset)."""

    def store(
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
            if lk is None or (found := lk.get(parent)) is None:
                return False
            pos = _pos(found, parent)
            if pos < 0:
                return False
            if pos >= _cutoff(found, worker):  # a stale entry: forgotten, the store refused
                self._forget(lk, worker, parent)
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
                    self._point(worker, lk, hashes, node)
                    return True
            elif not node.internal and node.edge[at:] == ed[: 3 * rest]:
                _extend_leaf(node, worker, solo, ed[3 * rest :])
                self._point(worker, lk, hashes, node)
                return True
            self._split(node, pos + 1)
        last = parent
        i = 0
        while i < total:
            if last is not None and node.edge[-2] != last and _pos(node, last) < 0:
                # the reference (``child_lookup_plan``): the rank's last block is not the run's
                # tail (it matched a run stored under other engine hashes), a stale parent; the
                # rest of the store is refused, the blocks matched so far stay
                return False
            kids = node.children
            first = ed[3 * i]
            child = kids.get(first) if kids else None
            if child is not None and child.dead:
                child = None  # dropped: the store's own run takes its place
            if child is None:
                if (
                    last is not None
                    and not node.internal
                    and node.edge[-2] == last
                    and len(node.edge) // 3 <= _cutoff(node, worker)
                ):
                    _extend_leaf(node, worker, solo, ed[3 * i :])
                    self._point(worker, lk, hashes[i:], node)
                    return True
                new = _Node(ed[3 * i :], solo)
                if kids is None:
                    kids = node.children = {}
                kids[first] = new
                node.internal = True
                self._point(worker, lk, hashes[i:], new)
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
                    self._point(worker, lk, hashes[i:], child)
                    return True
                self._split(child, m)
                _promote(child, worker, solo)
                tail = _Node(ed[3 * (i + m) :], solo)
                children = child.children
                assert children is not None  # the split gave it the rest of its run
                children[ed[3 * (i + m)]] = tail
                self._point(worker, lk, hashes[i : i + m], child)
                self._point(worker, lk, hashes[i + m :], tail)
                return True
            _promote(child, worker, solo)
            self._point(worker, lk, hashes[i : i + e], child)
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

    def remove(self, worker: WorkerWithDpRank, block_hashes: Sequence[int]) -> int:
        """Drop the named blocks from ``worker``; returns how many went.

        As the reference's tree: a removed block takes with it the rest of its run that the
        rank holds (the blocks the run's holders stored together), but not the runs below it
        (the rank keeps them; no prompt reaches them through the removed block). Consecutive
        hashes of one run (the run the rank last stored the first of them in) are removed from
        the first of them in the run (``_cut``)."""
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
            self._lookup[worker] = compact(lk)
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
                self._forget(lk, worker, h)
            return
        self._cut(lk, worker, node, best, best_hash)
        for h in unmatched:
            other = lk.get(h)
            if other is None:
                continue
            p = _pos(other, h)
            if p < 0:
                self._forget(lk, worker, h)
            else:
                self._cut(lk, worker, other, p, h)

    def _cut(
        self, lk: dict[int, _Node], worker: WorkerWithDpRank, node: _Node, pos: int, h: int
    ) -> None:
        """``worker`` keeps only the blocks of ``node`` before ``pos``; a run no rank holds whole
        any more loses its children (they stay in their holders' maps, out of every prompt's
        and the dump's reach). The rank's lookup loses the hashes of the blocks it held there,
        wherever it names them (as the reference: a run of the same hashes under other tokens
        keeps the rank's blocks but no longer serves as a parent); the hashes of the run past
        what the rank held stay where they are."""
        held = _cutoff(node, worker)
        if pos >= held:
            lk.pop(h, None)
        else:
            for s in node.edge[3 * pos + 1 : 3 * held : 3]:
                other = lk.pop(s, None)
                if other is not None and other is not node and _cutoff(other, worker) > 0:
                    self._suspect.add(worker)  # still holds that run, no longer named
            if pos == 0:
                _drop(node, worker)
            else:
                _discard(node, worker)
                if node.cut is None:
                    node.cut = {}
                node.cut[worker] = pos
        if not node.full and node.children:
            node.children = None

    def _point(
        self, worker: WorkerWithDpRank, lk: dict[int, _Node], hashes: Sequence[int], node: _Node
    ) -> None:
        """Name ``node`` as the run of ``hashes`` in the rank's lookup."""
        for h in hashes:
            old = lk.get(h)
            if old is not None and old is not node and _cutoff(old, worker) > 0:
                self._suspect.add(worker)  # the old run is still held, and no longer named
            lk[h] = node

    def _forget(self, lk: dict[int, _Node], worker: WorkerWithDpRank, h: int) -> None:
        """Drop ``h`` from the rank's lookup (noting when the rank still holds its run)."""
        node = lk.pop(h, None)
        if node is not None and _cutoff(node, worker) > 0:
            self._suspect.add(worker)

    def clear(self, worker: WorkerWithDpRank, prune: bool) -> int | None:
        """Forget every block ``worker`` holds here: how many (None: it has no lookup).
        ``prune``: as ``KvIndex.clear_rank``."""
        n = 0
        lk = self._lookup.pop(worker, None)
        self._solos.pop(worker, None)
        if lk is not None:
            n += len(lk)
            nodes: Iterator[_Node] | set[_Node] = set(lk.values())
            if worker in self._suspect:
                self._suspect.discard(worker)
                nodes = self._all_nodes()
            for node in nodes:
                if _drop(node, worker) and not node.full:
                    node.children = None
                    if prune and not node.cut:
                        node.dead = True
        return None if lk is None else n

    def _all_nodes(self) -> Iterator[_Node]:
        """Every run reachable from the root (a clear of a rank whose lookup lost runs)."""
        stack = list((self._root.children or {}).values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            yield node

    def prefix(self, keys: Sequence[int]) -> dict[WorkerWithDpRank, tuple[int, int]]:
        """Each rank's device prefix and the engine hash of its last block in it, as the
        reference's tree walk (1.6.1) scores it: the ranks holding the whole first run are
        active, those holding a prefix of it score that; at each deeper run an active rank
        scores where its hold ends and drops out. Where the run has no partial holders and as
        many full holders as there are active ranks, the reference takes them to be the active
        ranks and compares nothing (a rank can then be credited with a run it does not hold;
        this index gives the same scores). Work: the prompt's chain keys compared once, plus
        the ranks that drop out."""
        result: dict[WorkerWithDpRank, tuple[int, int]] = {}
        n = len(keys)
        kids = self._root.children
        node = kids.get(keys[0]) if kids else None
        probes = 1
        if node is None:
            self.probes += probes
            return result
        active: set[WorkerWithDpRank] | None = None
        pos = 0
        prev_last = 0
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
                        k = min(c, m)
                        if k:
                            result[w] = (k, ne[3 * k - 2])
            elif cut:
                full = node.full
                for w in [w for w in active if w not in full]:
                    held_to = cut.get(w)
                    k = 0 if held_to is None else min(held_to, m)
                    result[w] = (pos + k, ne[3 * k - 2] if k else prev_last)
                    active.discard(w)
                    probes += 1
            elif len(node.full) != len(active):
                gone = active - node.full
                for w in gone:
                    result[w] = (pos, prev_last)
                active -= gone
                probes += len(gone)
            pos += m
            prev_last = ne[3 * m - 2]
            if not active or m < e or pos == n:
                break
            kids = node.children
            node = kids.get(keys[pos]) if kids else None
            probes += 1
            if node is None:
                break
        for w in active:
            result[w] = (pos, prev_last)
        self.probes += probes
        return result

    def blocks(self) -> Iterator[IndexedBlock]:
        """The runs reachable from the root: each rank's part of a run, under the run's parent
        block, as the reference's ``/dump``."""
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

    def runs(self) -> Iterator[StoredChain]:
        """The device blocks as the reference's ``/dump`` gives them (``dump_tree_as_events``):
        runs taken breadth first from the root, a run merged with its only live child while
        both are held whole by the same ranks, one chain per rank holding it (whole, or the
        prefix a partial holder holds), under the engine hash of the block before it."""
        queue: deque[tuple[_Node, int | None]] = deque(
            (c, None) for c in (self._root.children or {}).values()
        )
        while queue:
            node, parent = queue.popleft()
            merged: list[tuple[int, int]] = []
            while True:
                kids = node.children
                if not node.full and not node.cut and not kids:
                    break
                edge = node.edge
                merged.extend(zip(edge[1::3], edge[2::3], strict=True))
                live = [c for c in kids.values() if c.full or c.cut or c.children] if kids else []
                if (
                    not node.cut
                    and len(live) == 1
                    and not live[0].cut
                    and live[0].full
                    and live[0].full == node.full
                ):
                    node = live[0]
                    continue
                if not merged:
                    break
                for w in node.full:
                    yield StoredChain(w, DEVICE, parent, tuple(merged))
                if node.cut:
                    for w, c in node.cut.items():
                        yield StoredChain(w, DEVICE, parent, tuple(merged[:c]))
                last = merged[-1][0]
                queue.extend((c, last) for c in live)
                break

    def holds(self, worker: WorkerWithDpRank, parent: int) -> bool:
        """Whether ``store`` would find ``parent`` for a device block."""
        lk = self._lookup.get(worker)
        return lk is not None and parent in lk

    def ranks(self) -> list[WorkerWithDpRank]:
        return list(self._lookup)

    def size(self) -> int:
        """Blocks in the ranks' lookups."""
        return sum(len(lk) for lk in self._lookup.values())
