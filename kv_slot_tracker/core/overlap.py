"""Prefix-overlap index: one compressed trie (radix tree) of active prompts for all ranks.

Each node carries an edge label (a run of hashes) and, per rank, how many active requests'
prompts pass through it; every prompt ends on a node boundary, so all positions of one edge are
held by the same ranks. A rank present at a node is present at every ancestor, so one walk of a
query finds every rank's overlap: a rank "drops out" at the first node that no longer holds it.
A query costs O(overlap length + the holders of each node where ranks drop out), never
O(ranks x prompt length), and a prompt's unique tail is one node, however long.

This is the prefix rule of SPEC §4.9 (a hash present elsewhere but off the query's path does not
count), which also holds for inputs whose hashes are not chained.

Memory: with many active requests most nodes are the unique tail of one request, held once by
one rank, and most hashes of a new prompt repeat a path already in the trie. So:

* a prompt given as a ``list`` is kept, not copied: its unique tail becomes a *view* (the node's
  edge is ``prompt[lo:]``), and the ints of the part that follows existing edges are swapped
  for the equal ints of those edges, so the request's own copies are freed. Lists given to
  ``add`` must not change afterwards (their values never do; only which int objects hold them);
* a node that exactly one prompt holds shares one read-only holder map per rank (``_Solo``),
  copied on the first write, instead of owning a dict.

A view is only ever held by the prompt it belongs to: a second prompt passing through the node
copies the edge into a tuple, and a split keeps the lower part a (shorter) view.
"""

from __future__ import annotations

from collections.abc import Sequence

from .limits import Usage
from .types import WorkerWithDpRank

Holders = dict[WorkerWithDpRank, int]
Edge = tuple[int, ...] | list[int]  # a list is a view: the edge is edge[lo:]


class _Solo(dict[WorkerWithDpRank, int]):
    """``{rank: 1}`` shared by every node that exactly one prompt holds. Never mutated: a
    node that gains a holder gets its own dict first."""

    __slots__ = ()


class _Node:
    __slots__ = ("edge", "lo", "children", "workers")

    def __init__(self, edge: Edge, workers: Holders, lo: int = 0) -> None:
        self.edge = edge
        self.lo = lo  # where a view starts in its list; 0 for a tuple edge
        self.children: dict[int, _Node] | None = None
        self.workers = workers


def _ints(node: _Node) -> tuple[int, ...]:
    edge = node.edge
    if type(edge) is tuple:
        return edge
    return tuple(edge[node.lo :] if node.lo else edge)


def _common(edge: Sequence[int], seq: Sequence[int], start: int) -> int:
    """Length of the common prefix of ``edge`` and ``seq[start:]``."""
    n = min(len(edge), len(seq) - start)
    k = 0
    while k < n and edge[k] == seq[start + k]:
        k += 1
    return k


class PromptTrie:
    __slots__ = ("root", "_nodes", "_solos", "usage")

    def __init__(self, usage: Usage | None = None) -> None:
        # counts the hashes of the prompts indexed (a prompt's every hash, per prompt) across
        # tries; a trie's own count is its ranks' (``ActiveSequencesMultiWorker.held_hashes``)
        self.usage = Usage() if usage is None else usage
        self.root = _Node((), {})
        self._nodes = 0
        self._solos: dict[WorkerWithDpRank, _Solo] = {}

    def __len__(self) -> int:
        """Number of live nodes (0 when no active prompt has a block)."""
        return self._nodes

    def is_empty(self) -> bool:
        return not self.root.children

    def _solo(self, worker: WorkerWithDpRank) -> _Solo:
        solo = self._solos.get(worker)
        if solo is None:
            solo = self._solos[worker] = _Solo({worker: 1})
        return solo

    def add(self, worker: WorkerWithDpRank, prompt: Sequence[int]) -> list[Sequence[int]]:
        """Index one prompt of ``worker``. A ``list`` is kept as described in the module notes.

        Returns the edges (runs of hashes) that ``worker`` holds now and did not before: its
        block counts take one hold per position of those (``BlockTracker``)."""
        n = len(prompt)
        self.usage.hashes += n
        src = prompt if type(prompt) is list else None
        if type(prompt) is not tuple:
            prompt = tuple(prompt)
        node = self.root
        i = 0
        gained: list[Sequence[int]] = []
        while i < n:
            children = node.children
            if children is None or (child := children.get(prompt[i])) is None:
                solo = self._solos.get(worker) or self._solo(worker)
                tail = prompt[i:]
                leaf = _Node(tail, solo) if src is None else _Node(src, solo, i)
                if children is None:
                    node.children = {prompt[i]: leaf}
                else:
                    children[prompt[i]] = leaf
                self._nodes += 1
                gained.append(tail)
                return gained
            edge = child.edge
            view = type(edge) is list
            if view:
                edge = _ints(child)
            size = len(edge)
            if prompt[i : i + size] != edge:
                # diverges (or ends) inside the edge: split it so the prompt ends on a boundary
                k = _common(edge, prompt, i)
                held = child.workers
                mid = _Node(edge[:k], held if type(held) is _Solo else dict(held))
                if view:  # the lower part stays a view, just shorter
                    child.lo += k
                else:
                    child.edge = edge[k:]
                mid.children = {edge[k]: child}
                children[prompt[i]] = mid
                self._nodes += 1
                child, size, edge = mid, k, mid.edge
            elif view:  # a second prompt passes the whole edge: give it its own copy
                child.edge, child.lo = edge, 0
            if src is not None:
                src[i : i + size] = edge  # equal values; the index's ints, so ours can go
            workers = child.workers
            if type(workers) is _Solo:
                workers = child.workers = dict(workers)
            c = workers.get(worker, 0)
            workers[worker] = c + 1
            if not c:
                gained.append(edge)
            node = child
            i += size
        return gained

    def remove(self, worker: WorkerWithDpRank, prompt: Sequence[int]) -> list[Sequence[int]]:
        """Unindex one prompt ``add`` indexed for ``worker``; returns the edges ``worker`` no
        longer holds (the counterpart of what ``add`` returns).

        A node held by more than one prompt keeps a holder, so only nodes this prompt alone
        holds go, and those are the end of its path: a node's holders include its children's,
        so below the first one every node on the path is this prompt's alone too. That part
        is cut off in one step and is returned as one run of hashes."""
        node = self.root
        i, n = 0, len(prompt)
        self.usage.hashes -= n
        lost: list[Sequence[int]] = []
        while i < n:
            key = prompt[i]
            children = node.children
            assert children is not None  # the prompt was added: its path is there
            child = children[key]
            workers = child.workers
            if type(workers) is _Solo:  # held by this prompt only, and so is all below it
                del children[key]
                if not children:
                    node.children = None
                gone = 1
                while child.children:
                    (child,) = child.children.values()
                    gone += 1
                self._nodes -= gone
                lost.append(prompt[i:])
                return lost
            # held by two prompts or more (a dict): one holder at least stays
            c = workers[worker] - 1
            if c:
                workers[worker] = c
                if c == 1 and len(workers) == 1:
                    child.workers = self._solo(worker)  # back to one prompt: share the map
            else:
                del workers[worker]
                lost.append(child.edge)  # a tuple: a view is held by one prompt only
                if len(workers) == 1:
                    ((only, count),) = workers.items()
                    if count == 1:
                        child.workers = self._solo(only)
            i += len(child.edge)
            node = child
        return lost

    def exclusive_from(self, worker: WorkerWithDpRank, prompt: Sequence[int]) -> int:
        """For a prompt ``worker`` holds: where the nodes that only this prompt of ``worker``
        holds begin (``len(prompt)`` if none). Holder counts never grow along a path, so those
        nodes are the end of it; the walk costs O(nodes), not O(positions)."""
        node = self.root
        i, n = 0, len(prompt)
        while i < n:
            children = node.children
            assert children is not None  # the prompt is held: its path is there
            child = children[prompt[i]]
            if child.workers[worker] == 1:
                return i
            i += len(child.edge) - child.lo
            node = child
        return n

    def held_positions(self, worker: WorkerWithDpRank) -> dict[int, int]:
        """How many positions of the nodes ``worker`` holds carry each hash (a full walk, for
        consistency checks)."""
        out: dict[int, int] = {}
        stack = list((self.root.children or {}).values())
        while stack:
            node = stack.pop()
            if worker in node.workers:
                for h in _ints(node):
                    out[h] = out.get(h, 0) + 1
                stack.extend((node.children or {}).values())
        return out

    def overlaps(self, query: Sequence[int]) -> dict[WorkerWithDpRank, int]:
        """Overlap depth per rank, for ranks with a non-zero overlap."""
        if type(query) is not tuple:
            query = tuple(query)
        node = self.root
        # the matched path as (holders, depth reached), one entry per run of nodes with the
        # same holders: a node's holders are a subset of its parent's, so equal sizes mean
        # equal sets, and only a smaller set starts a new entry (some rank dropped out)
        path: list[tuple[Holders, int]] = []
        size_held = -1
        depth, n = 0, len(query)
        while depth < n:
            children = node.children
            child = children.get(query[depth]) if children is not None else None
            if child is None:
                break
            workers = child.workers
            edge = child.edge
            if type(edge) is not tuple:
                edge = _ints(child)
            size = len(edge)
            full = query[depth : depth + size] == edge
            depth += size if full else _common(edge, query, depth)
            if len(workers) == size_held:
                path[-1] = (workers, depth)
            else:
                path.append((workers, depth))
                size_held = len(workers)
            if not full:
                break
            node = child
        # each entry's ranks hold every entry above it, so a deeper entry overwrites the depth
        # of the ranks that go on and the others keep where they dropped out (all in C)
        result: dict[WorkerWithDpRank, int] = {}
        for workers, reached in path:
            result.update(dict.fromkeys(workers, reached))
        return result

    def expanded(self) -> dict[tuple[int, ...], dict[WorkerWithDpRank, int]]:
        """Every prefix with its holders, independent of how edges happen to be split."""
        out: dict[tuple[int, ...], dict[WorkerWithDpRank, int]] = {}
        stack: list[tuple[_Node, tuple[int, ...]]] = [(self.root, ())]
        while stack:
            node, prefix = stack.pop()
            edge = _ints(node)
            for k in range(1, len(edge) + 1):
                out[prefix + edge[:k]] = dict(node.workers)
            prefix = prefix + edge
            for child in (node.children or {}).values():
                stack.append((child, prefix))
        return out

    def assert_consistent(self) -> None:
        """Shared holder maps are intact, views belong to solo nodes, the node count is right."""
        for worker, solo in self._solos.items():
            assert type(solo) is _Solo and solo == {worker: 1}, f"shared map of {worker} changed"
        stack = list((self.root.children or {}).items())
        count = 0
        while stack:
            key, node = stack.pop()
            count += 1
            edge = _ints(node)
            assert edge and edge[0] == key, "a child is filed under its edge's first hash"
            assert node.workers, "an empty node was left in the trie"
            if type(node.workers) is not _Solo:
                assert sum(node.workers.values()) >= 2, "one prompt's node has its own map"
            if type(node.edge) is tuple:
                assert node.lo == 0
            else:
                assert type(node.workers) is _Solo, "a node shared by prompts kept a view"
                assert 0 <= node.lo < len(node.edge)
            stack.extend((node.children or {}).items())
        assert count == self._nodes, f"node count {self._nodes} != {count}"
