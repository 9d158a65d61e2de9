"""Prefix-overlap index: one compressed trie (radix tree) of active prompts for all ranks.

Each node carries an edge label (a run of hashes) and, per rank, how many active requests'
prompts pass through it; every prompt ends on a node boundary, so all positions of one edge are
held by the same ranks. A rank present at a node is present at every ancestor, so one walk of a
query finds every rank's overlap: a rank "drops out" at the first node that no longer holds it.
A query costs O(overlap length + ranks that drop out), never O(ranks x prompt length), and a
prompt's unique tail is one node, however long.

This is the prefix rule of SPEC §4.9 (a hash present elsewhere but off the query's path does not
count), which also holds for inputs whose hashes are not chained.
"""

from __future__ import annotations

from collections.abc import Sequence

from .types import WorkerWithDpRank


class _Node:
    __slots__ = ("edge", "children", "workers")

    def __init__(self, edge: tuple[int, ...], workers: dict[WorkerWithDpRank, int]) -> None:
        self.edge = edge
        self.children: dict[int, _Node] | None = None
        self.workers = workers


def _common(edge: tuple[int, ...], seq: Sequence[int], start: int) -> int:
    """Length of the common prefix of ``edge`` and ``seq[start:]``."""
    n = min(len(edge), len(seq) - start)
    k = 0
    while k < n and edge[k] == seq[start + k]:
        k += 1
    return k


class PromptTrie:
    __slots__ = ("root", "_nodes")

    def __init__(self) -> None:
        self.root = _Node((), {})
        self._nodes = 0

    def __len__(self) -> int:
        """Number of live nodes (0 when no active prompt has a block)."""
        return self._nodes

    def is_empty(self) -> bool:
        return not self.root.children

    def add(self, worker: WorkerWithDpRank, prompt: Sequence[int]) -> None:
        if type(prompt) is not tuple:
            prompt = tuple(prompt)
        node = self.root
        i, n = 0, len(prompt)
        while i < n:
            children = node.children
            child = children.get(prompt[i]) if children is not None else None
            if child is None:
                leaf = _Node(prompt[i:], {worker: 1})
                if children is None:
                    node.children = {prompt[i]: leaf}
                else:
                    children[prompt[i]] = leaf
                self._nodes += 1
                return
            edge = child.edge
            size = len(edge)
            if prompt[i : i + size] != edge:
                # diverges (or ends) inside the edge: split it so the prompt ends on a boundary
                k = _common(edge, prompt, i)
                mid = _Node(edge[:k], dict(child.workers))
                child.edge = edge[k:]
                mid.children = {child.edge[0]: child}
                children[prompt[i]] = mid  # type: ignore[index]
                self._nodes += 1
                child, size = mid, k
            workers = child.workers
            workers[worker] = workers.get(worker, 0) + 1
            node = child
            i += size

    def remove(self, worker: WorkerWithDpRank, prompt: Sequence[int]) -> None:
        node = self.root
        i, n = 0, len(prompt)
        path: list[tuple[_Node, _Node]] = []
        while i < n:
            child = node.children[prompt[i]]  # type: ignore[index]
            workers = child.workers
            c = workers[worker] - 1
            if c:
                workers[worker] = c
            else:
                del workers[worker]
            path.append((node, child))
            i += len(child.edge)
            node = child
        for parent, child in reversed(path):
            if child.workers:
                break
            del parent.children[child.edge[0]]  # type: ignore[union-attr]
            if not parent.children:
                parent.children = None
            self._nodes -= 1

    def overlaps(self, query: Sequence[int]) -> dict[WorkerWithDpRank, int]:
        """Overlap depth per rank, for ranks with a non-zero overlap."""
        if type(query) is not tuple:
            query = tuple(query)
        result: dict[WorkerWithDpRank, int] = {}
        node = self.root
        holders: dict[WorkerWithDpRank, int] | None = None
        depth, n = 0, len(query)
        while depth < n:
            children = node.children
            child = children.get(query[depth]) if children is not None else None
            if child is None:
                break
            workers = child.workers
            if holders is not None and len(workers) != len(holders):
                for w in holders:
                    if w not in workers:
                        result[w] = depth
            holders = workers
            edge = child.edge
            size = len(edge)
            if query[depth : depth + size] == edge:
                depth += size
                node = child
                continue
            depth += _common(edge, query, depth)
            break
        if holders:
            for w in holders:
                result[w] = depth
        return result

    def expanded(self) -> dict[tuple[int, ...], dict[WorkerWithDpRank, int]]:
        """Every prefix with its holders, independent of how edges happen to be split."""
        out: dict[tuple[int, ...], dict[WorkerWithDpRank, int]] = {}
        stack: list[tuple[_Node, tuple[int, ...]]] = [(self.root, ())]
        while stack:
            node, prefix = stack.pop()
            for k in range(1, len(node.edge) + 1):
                out[prefix + node.edge[:k]] = dict(node.workers)
            prefix = prefix + node.edge
            for child in (node.children or {}).values():
                stack.append((child, prefix))
        return out
