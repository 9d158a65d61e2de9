"""Prefix-overlap index: one trie of active prompts for all ranks of a tracker.

Each node on a prompt's path counts, per rank, how many active requests pass through it. A rank's
overlap with a query is the depth of the deepest node on the query's path that the rank still
holds. Because a rank present at a node is present at every ancestor, one walk of the query finds
every rank's overlap: a rank "drops out" at the first node that no longer holds it, so the cost is
O(overlap length + ranks that drop out along the way), never O(ranks x prompt).

This is the prefix rule of SPEC §4.9 (a hash present elsewhere but off the query's path does not
count), which also holds for inputs whose hashes are not chained.
"""

from __future__ import annotations

from .types import WorkerWithDpRank


class _Node:
    __slots__ = ("children", "workers")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.workers: dict[WorkerWithDpRank, int] = {}


class PromptTrie:
    __slots__ = ("root", "_nodes")

    def __init__(self) -> None:
        self.root = _Node()
        self._nodes = 0

    def __len__(self) -> int:
        """Number of live nodes (0 when no active prompt has a block)."""
        return self._nodes

    def is_empty(self) -> bool:
        return not self.root.children

    def add(self, worker: WorkerWithDpRank, prompt: list[int]) -> None:
        node = self.root
        for h in prompt:
            child = node.children.get(h)
            if child is None:
                child = node.children[h] = _Node()
                self._nodes += 1
            workers = child.workers
            workers[worker] = workers.get(worker, 0) + 1
            node = child

    def remove(self, worker: WorkerWithDpRank, prompt: list[int]) -> None:
        node = self.root
        path: list[tuple[_Node, int, _Node]] = []
        for h in prompt:
            child = node.children[h]
            workers = child.workers
            n = workers[worker] - 1
            if n:
                workers[worker] = n
            else:
                del workers[worker]
            path.append((node, h, child))
            node = child
        for parent, h, child in reversed(path):
            if child.workers:
                break
            del parent.children[h]
            self._nodes -= 1

    def overlaps(self, query: list[int]) -> dict[WorkerWithDpRank, int]:
        """Overlap depth per rank, for ranks with a non-zero overlap."""
        result: dict[WorkerWithDpRank, int] = {}
        node = self.root
        holders: dict[WorkerWithDpRank, int] | None = None
        depth = 0
        for h in query:
            child = node.children.get(h)
            if child is None:
                break
            workers = child.workers
            if holders is not None and len(workers) != len(holders):
                for w in holders:
                    if w not in workers:
                        result[w] = depth
            holders = workers
            depth += 1
            node = child
        if holders:
            for w in holders:
                result[w] = depth
        return result

    def holders(self) -> set[WorkerWithDpRank]:
        """Every rank that holds at least one node (for invariant checks)."""
        out: set[WorkerWithDpRank] = set()
        stack = [self.root]
        while stack:
            n = stack.pop()
            out.update(n.workers)
            stack.extend(n.children.values())
        return out
