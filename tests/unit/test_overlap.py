"""The overlap index (``PromptTrie``): what it stores for a prompt held once, and how that
storage changes as other prompts share it. Overlap semantics are covered by
``test_overlap_property.py``; these tests pin the compact layout."""

from __future__ import annotations

import random

from kv_slot_tracker.core.overlap import PromptTrie, _Solo
from kv_slot_tracker.core.types import WorkerWithDpRank

A, B = WorkerWithDpRank(1, 0), WorkerWithDpRank(2, 0)
BIG = 2**63  # ints this large are distinct objects even when equal


def check(trie: PromptTrie) -> None:
    trie.assert_consistent()


def test_a_prompt_held_once_is_a_view_of_its_list() -> None:
    trie = PromptTrie()
    p = [1, 2, 3, 4]
    trie.add(A, p)
    check(trie)
    leaf = trie.root.children[1]
    assert leaf.edge is p and leaf.lo == 0  # no copy of the hashes
    assert type(leaf.workers) is _Solo and leaf.workers == {A: 1}
    assert trie.overlaps([1, 2, 3, 9]) == {A: 3}


def test_a_tuple_is_copied() -> None:
    trie = PromptTrie()
    trie.add(A, (1, 2, 3))
    check(trie)
    assert trie.root.children[1].edge == (1, 2, 3)
    assert trie.expanded() == {(1,): {A: 1}, (1, 2): {A: 1}, (1, 2, 3): {A: 1}}


def test_the_shared_part_of_a_new_prompt_reuses_the_index_ints() -> None:
    trie = PromptTrie()
    trie.add(A, (BIG + 1, BIG + 2, BIG + 3))
    edge = trie.root.children[BIG + 1].edge
    p = [BIG + 1, BIG + 2, BIG + 9]
    own = p[2]
    trie.add(B, p)
    check(trie)
    assert p == [BIG + 1, BIG + 2, BIG + 9]
    assert p[0] is edge[0] and p[1] is edge[1]  # the index's ints, ours freed
    assert p[2] is own
    assert trie.overlaps([BIG + 1, BIG + 2, BIG + 3]) == {A: 3, B: 2}


def test_solo_nodes_on_one_rank_share_one_holder_map() -> None:
    trie = PromptTrie()
    trie.add(A, [1, 2])
    trie.add(A, [3, 4])
    check(trie)
    assert trie.root.children[1].workers is trie.root.children[3].workers


def test_a_split_keeps_the_lower_part_a_view_and_copies_the_shared_part() -> None:
    trie = PromptTrie()
    first = [1, 2, 3, 4, 5]
    second = [1, 2, 9]
    trie.add(A, first)
    trie.add(B, second)
    check(trie)
    mid = trie.root.children[1]
    assert type(mid.edge) is tuple and mid.edge == (1, 2)
    assert type(mid.workers) is dict and mid.workers == {A: 1, B: 1}
    lower = mid.children[3]
    assert lower.edge is first and lower.lo == 2  # hashes 3, 4, 5 of the first prompt
    assert type(lower.workers) is _Solo
    tail = mid.children[9]
    assert tail.edge is second and tail.lo == 2
    assert trie.overlaps([1, 2, 3, 4, 7]) == {A: 4, B: 2}
    assert len(trie) == 3


def test_a_second_prompt_through_a_view_gives_the_node_its_own_edge() -> None:
    trie = PromptTrie()
    trie.add(A, [1, 2, 3])
    trie.add(A, [1, 2, 3, 4])
    check(trie)
    node = trie.root.children[1]
    assert node.edge == (1, 2, 3) and type(node.edge) is tuple and node.lo == 0
    assert node.workers == {A: 2}
    assert trie.overlaps([1, 2, 3, 4]) == {A: 4}


def test_removal_hands_a_node_back_to_the_shared_map_and_drops_empty_ones() -> None:
    trie = PromptTrie()
    trie.add(A, [1, 2, 3])
    trie.add(B, [1, 2, 7, 8])
    trie.remove(B, [1, 2, 7, 8])
    check(trie)
    mid = trie.root.children[1]
    assert type(mid.workers) is _Solo and mid.workers == {A: 1}
    assert list(mid.children) == [3]
    assert len(trie) == 2
    trie.remove(A, [1, 2, 3])
    check(trie)
    assert trie.is_empty() and len(trie) == 0
    assert trie.overlaps([1, 2, 3]) == {}


def test_lists_and_tuples_index_alike() -> None:
    """The same random lifecycle fed as lists and as tuples gives the same index at every step
    (prompts share prefixes, repeat, nest and split edges, views and copies mix)."""
    rng = random.Random(7)
    ranks = [A, B, WorkerWithDpRank(2, 1)]
    by_list, by_tuple = PromptTrie(), PromptTrie()
    active: list[tuple[WorkerWithDpRank, list[int]]] = []
    for _ in range(400):
        if active and rng.random() < 0.45:
            worker, hashes = active.pop(rng.randrange(len(active)))
            by_list.remove(worker, hashes)
            by_tuple.remove(worker, tuple(hashes))
        else:
            base = rng.choice([[], [1, 2, 3], [1, 2, 4, 5], [7]])
            hashes = base + [rng.randrange(1, 9) for _ in range(rng.randrange(0, 4))]
            if not hashes:
                continue
            worker = rng.choice(ranks)
            by_list.add(worker, hashes)
            by_tuple.add(worker, tuple(hashes))
            active.append((worker, hashes))
        check(by_list)
        check(by_tuple)
        assert by_list.expanded() == by_tuple.expanded()
        assert len(by_list) == len(by_tuple)
        query = [1, 2, rng.randrange(1, 9), rng.randrange(1, 9)]
        assert by_list.overlaps(query) == by_tuple.overlaps(query)
    for worker, hashes in active:
        by_list.remove(worker, hashes)
        by_tuple.remove(worker, hashes)
    assert by_list.is_empty() and len(by_list) == 0 and by_tuple.is_empty()


def test_add_and_remove_report_the_edges_a_rank_starts_and_stops_holding() -> None:
    a, b = WorkerWithDpRank(1, 0), WorkerWithDpRank(2, 0)
    trie = PromptTrie()
    assert [tuple(e) for e in trie.add(a, [1, 2, 3])] == [(1, 2, 3)]
    assert [tuple(e) for e in trie.add(a, [1, 2, 3])] == []  # held already
    # b shares the prefix [1, 2] (a split) and brings its own tail
    assert [tuple(e) for e in trie.add(b, [1, 2, 9])] == [(1, 2), (9,)]
    assert [tuple(e) for e in trie.add(a, [1, 2, 8, 8])] == [(8, 8)]
    # where the nodes only one prompt of the rank holds begin: a holds [1, 2, 3] twice
    assert trie.exclusive_from(a, [1, 2, 3]) == 3
    assert trie.exclusive_from(a, [1, 2, 8, 8]) == 2
    assert trie.exclusive_from(b, [1, 2, 9]) == 0  # a's prompts are another rank's
    assert trie.held_positions(a) == {1: 1, 2: 1, 3: 1, 8: 2}
    assert [tuple(e) for e in trie.remove(a, [1, 2, 8, 8])] == [(8, 8)]
    assert [tuple(e) for e in trie.remove(a, [1, 2, 3])] == []  # a's other prompt holds on
    assert [tuple(e) for e in trie.remove(a, [1, 2, 3])] == [(1, 2), (3,)]
    # the last prompt's whole path goes at once, as one run
    assert [tuple(e) for e in trie.remove(b, [1, 2, 9])] == [(1, 2, 9)]
    assert trie.is_empty() and len(trie) == 0
